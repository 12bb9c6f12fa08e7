"""The global prefix tree (paper §4.2): one radix tree of token sequences for the cluster.

Per node: its tokens, the instances caching it, per-instance request timestamps in the
sliding window W; per instance, the nodes it holds in least-recently-used order (for the
virtual LRU eviction of load cost).
An instance *has* a node when its engine reported the tokens stored (``cached``) or when
requests routed there, still in flight, cover the node (``pending``): the router must
exploit a prefix it just placed before the engine's report arrives. When a request
finishes, its pending marks go and the engine's events say exactly what stayed cached, so
the tree mirrors the engines' radix caches. A node no instance has and no request used
within W is removed.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from dataclasses import dataclass, field

from preble_backend.radix_cache import CacheEvent


@dataclass(eq=False)
class GlobalNode:
    key: list[int]
    parent: GlobalNode | None = None
    children: dict[int, GlobalNode] = field(default_factory=dict)
    cached: set[int] = field(default_factory=set)
    pending: dict[int, int] = field(default_factory=dict)
    hits: dict[int, deque] = field(default_factory=dict)  # instance -> request times
    replicas: set[int] = field(default_factory=set)  # autoscaled copies (see e2.py)
    ttft: deque = field(default_factory=deque)  # (time, ttft) of requests keyed here (e2.py)

    def held_by(self, instance: int) -> bool:
        return instance in self.cached or self.pending.get(instance, 0) > 0

    def holders(self) -> set[int]:
        return self.cached | {i for i, n in self.pending.items() if n > 0}

    def path(self) -> list[GlobalNode]:
        nodes, node = [], self
        while node.parent is not None:
            nodes.append(node)
            node = node.parent
        return nodes[::-1]


@dataclass
class Match:
    """A prompt matched against the tree: the nodes it runs through and how many of each
    node's tokens it matches (only the last may be partial)."""

    nodes: list[GlobalNode]
    lengths: list[int]

    @property
    def matched(self) -> int:
        return sum(self.lengths)

    def cached_on(self, instance: int) -> int:
        """Prompt tokens the instance holds: the matched path up to its first gap."""
        total = 0
        for node, n in zip(self.nodes, self.lengths):
            if not node.held_by(instance):
                break
            total += n
        return total

    def key_portion(self) -> GlobalNode | None:
        """The paper's key portion (§3): the deepest node on the path holding more tokens
        than all its predecessors together."""
        key, before = None, 0
        for node, n in zip(self.nodes, self.lengths):
            if n > before:
                key = node
            before += n
        return key


class GlobalPrefixTree:
    def __init__(self, num_instances: int, window_s: float = 180.0) -> None:
        self.root = GlobalNode(key=[])
        self.num_instances = num_instances
        self.window_s = window_s
        self.cached_tokens = [0] * num_instances  # confirmed by engine events
        self.held_tokens = [0] * num_instances  # confirmed or pending
        # Per instance, nodes it holds in least-recently-used order (oldest first).
        self.lru: list[OrderedDict[int, GlobalNode]] = [OrderedDict() for _ in range(num_instances)]

    # ---- matching -------------------------------------------------------------------------

    def match(self, tokens: list[int]) -> Match:
        """Read-only walk over nodes some instance holds."""
        nodes, lengths, node, pos = [], [], self.root, 0
        while pos < len(tokens) and (child := node.children.get(tokens[pos])) is not None:
            if not child.holders():
                break
            n = _common(child.key, tokens, pos)
            nodes.append(child)
            lengths.append(n)
            pos += n
            if n < len(child.key):
                break
            node = child
        return Match(nodes, lengths)

    def _walk_insert(self, tokens: list[int], cut: int = 0) -> list[GlobalNode]:
        """The path of nodes spelling exactly ``tokens`` (splitting and adding as needed),
        with a node boundary at ``cut`` as well."""
        path, node, pos = [], self.root, 0
        while pos < len(tokens):
            child = node.children.get(tokens[pos])
            if child is None:
                end = cut if pos < cut < len(tokens) else len(tokens)
                child = GlobalNode(key=list(tokens[pos:end]), parent=node)
                node.children[tokens[pos]] = child
                path.append(child)
                pos, node = end, child
                continue
            n = _common(child.key, tokens, pos)
            if pos < cut < pos + n:
                n = cut - pos
            if n < len(child.key):
                child = self._split(child, n)
            path.append(child)
            pos += n
            node = child
        return path

    def _split(self, node: GlobalNode, n: int) -> GlobalNode:
        """Cut ``node`` after ``n`` tokens; the new upper half inherits everything (both
        halves were used and held by the same requests and instances)."""
        upper = GlobalNode(
            key=node.key[:n],
            parent=node.parent,
            cached=set(node.cached),
            pending=dict(node.pending),
            hits={i: deque(ts) for i, ts in node.hits.items()},
            replicas=set(node.replicas),
        )
        node.parent.children[upper.key[0]] = upper
        node.key, node.parent = node.key[n:], upper
        upper.children[node.key[0]] = node
        for lru in self.lru:
            if id(node) in lru:  # an ancestor is never older than its descendants
                lru[id(upper)] = upper
        return upper

    # ---- routing bookkeeping ----------------------------------------------------------------

    def route(self, tokens: list[int], instance: int, now: float) -> GlobalNode:
        """Record that a request with ``tokens`` goes to ``instance``; return its end node
        (hand it back to ``finish``)."""
        path = self._walk_insert(tokens)
        lru = self.lru[instance]
        for node in reversed(path):  # the root side ends up most recent
            if not node.held_by(instance):
                self.held_tokens[instance] += len(node.key)
            node.pending[instance] = node.pending.get(instance, 0) + 1
            node.hits.setdefault(instance, deque()).append(now)
            lru[id(node)] = node
            lru.move_to_end(id(node))
        return path[-1] if path else self.root

    def finish(self, end: GlobalNode, instance: int) -> None:
        node = end
        while node.parent is not None:
            left = node.pending.get(instance, 0) - 1
            if left > 0:
                node.pending[instance] = left
            else:
                node.pending.pop(instance, None)
                if instance not in node.cached:
                    self.lru[instance].pop(id(node), None)
                    self.held_tokens[instance] -= len(node.key)
            node = node.parent

    def requests_in_window(self, node: GlobalNode, instance: int, now: float) -> int:
        times = node.hits.get(instance)
        if not times:
            return 0
        while times and times[0] < now - self.window_s:
            times.popleft()
        return len(times)

    # ---- mirroring the engines ------------------------------------------------------------

    def apply_events(self, instance: int, events: list[CacheEvent]) -> None:
        """Mirror an engine's cache. The engine shares whole pages and this tree single
        tokens, so one node here can lie under several engine branches: an eviction
        unmarks a node only when no child of it is still cached (deepest first)."""
        for event in events:
            tokens, pos = list(event.tokens), 0
            span = []
            for node in self._walk_insert(tokens, cut=event.start):
                if pos >= event.start:
                    span.append(node)
                pos += len(node.key)
            if event.kind == "stored":
                for node in span:
                    if instance not in node.cached:
                        if not node.held_by(instance):
                            self.held_tokens[instance] += len(node.key)
                        node.cached.add(instance)
                        self.cached_tokens[instance] += len(node.key)
                        self.lru[instance].setdefault(id(node), node)
                continue
            for node in reversed(span):
                if any(instance in child.cached for child in node.children.values()):
                    break
                if instance in node.cached:
                    node.cached.discard(instance)
                    self.cached_tokens[instance] -= len(node.key)
                    if not node.held_by(instance):
                        self.lru[instance].pop(id(node), None)
                        self.held_tokens[instance] -= len(node.key)

    def cached_sequences(self, instance: int) -> set[tuple[int, ...]]:
        """Maximal cached token sequences of one instance (comparable with an engine's)."""
        out, stack = set(), [(self.root, ())]
        while stack:
            node, prefix = stack.pop()
            for child in node.children.values():
                if instance in child.cached:
                    seq = prefix + tuple(child.key)
                    if not any(instance in c.cached for c in child.children.values()):
                        out.add(seq)
                    stack.append((child, seq))
        return out

    # ---- forgetting -----------------------------------------------------------------------

    def prune(self, now: float) -> int:
        """Remove nodes that no instance holds and nobody used within the window, and merge
        a node with its only child when both carry the same state (evictions of a long
        prompt's tail, page run by page run, would otherwise leave it in fragments)."""
        removed, stack = 0, [self.root]
        order = []
        while stack:
            node = stack.pop()
            order.append(node)
            stack.extend(node.children.values())
        for node in reversed(order):  # children before parents
            if node is self.root:
                continue
            if not node.children:
                if node.holders() or any(self.requests_in_window(node, i, now) for i in list(node.hits)):
                    continue
                del node.parent.children[node.key[0]]
                for lru in self.lru:
                    lru.pop(id(node), None)
                removed += 1
            elif len(node.children) == 1:
                child = next(iter(node.children.values()))
                if self._same_state(node, child, now):
                    self._merge(node, child)
                    removed += 1
        return removed

    def _same_state(self, a: GlobalNode, b: GlobalNode, now: float) -> bool:
        if a.cached != b.cached or a.pending != b.pending or a.replicas != b.replicas:
            return False
        instances = set(a.hits) | set(b.hits)
        return all(
            self.requests_in_window(a, i, now) == self.requests_in_window(b, i, now) for i in instances
        )

    def _merge(self, node: GlobalNode, child: GlobalNode) -> None:
        """Fold ``child`` into ``node`` (its only child, same state)."""
        node.key = node.key + child.key
        node.children = child.children
        for grandchild in node.children.values():
            grandchild.parent = node
        for lru in self.lru:
            lru.pop(id(child), None)

    def num_nodes(self) -> int:
        count, stack = 0, list(self.root.children.values())
        while stack:
            node = stack.pop()
            count += 1
            stack.extend(node.children.values())
        return count


def _common(key: list[int], tokens: list[int], pos: int) -> int:
    """Length of the common prefix of ``key`` and ``tokens[pos:]``."""
    n = min(len(key), len(tokens) - pos)
    if (key if n == len(key) else key[:n]) == tokens[pos : pos + n]:
        return n
    lo, hi = 0, n  # binary search on slice equality: C-speed comparisons
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if key[:mid] == tokens[pos : pos + mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo
