"""The global prefix tree (paper §4.2): one radix tree of the cluster's prompts.

Keys are page chain hashes (``preble_backend/common/block_hash.py``), one per full KV page, so the
tree has the engines' own granularity (they share whole pages only) and a prompt is a list of a few
hundred numbers instead of thousands of tokens. A node is a run of pages (``tree_node.py``).

Per node: the instances caching it, per-instance request timestamps in the sliding window W; per
instance, the nodes it holds in least-recently-used order (for the virtual LRU eviction of load
cost) and the tokens its requests in flight pin, a shared page once. An instance *has* a node when
its engine reported the pages stored (``cached``) or when requests routed there, still in flight,
cover the node (``pending``): the router must exploit a prefix it just placed before the engine's
report arrives. When a request finishes, its pending marks go and the engine's events say exactly
what stayed cached, so the tree mirrors the engines' radix caches. A node no instance has and no
request used within W is removed.

Reading (``match``, ``eviction_order``, ``requests_in_window``) and changing (``route``, ``finish``,
``apply_events``, ``prune``) are separate methods: a policy may read freely while it decides and
changes the tree only to record what it decided.
"""

from __future__ import annotations

import heapq
import itertools
from array import array
from bisect import bisect_left
from collections import OrderedDict
from collections.abc import Iterator

from preble_backend.common.cache_event import CacheEvent
from preble_backend.common.settings import DEFAULT_PAGE_SIZE
from scheduler.host_mirror import HostTierMirror
from scheduler.tree_node import GlobalNode, Match, common_prefix
from scheduler.window_mirror import WindowMirror


class GlobalPrefixTree:
    def __init__(
        self, num_instances: int, window_s: float = 180.0, page_size: int = DEFAULT_PAGE_SIZE
    ) -> None:
        self.root = GlobalNode(array("Q"))
        self.num_instances = num_instances
        self.window_s = window_s
        self.page_size = page_size
        self.cached_tokens = [0] * num_instances  # confirmed by engine events
        self.held_tokens = [0] * num_instances  # confirmed or pending
        self.pinned_tokens = [0] * num_instances  # pending: the batch's KV, a shared page once
        # Per instance, nodes it holds in least-recently-used order (oldest first).
        self.lru: list[OrderedDict[GlobalNode, None]] = [OrderedDict() for _ in range(num_instances)]
        # Nodes nobody holds, by when their last request leaves the window: what prune checks.
        self._unheld: list[tuple[float, int, GlobalNode]] = []
        self._seq = itertools.count()
        self.host = HostTierMirror(num_instances)  # the engines' host tiers, beside the tree
        self.windows = WindowMirror(num_instances)  # the engines' sliding layers, beside the tree

    def add_instance(self) -> int:
        """A slot for one more instance (a node's per-instance state is keyed by it)."""
        self.num_instances += 1
        self.cached_tokens.append(0)
        self.held_tokens.append(0)
        self.pinned_tokens.append(0)
        self.lru.append(OrderedDict())
        self.host.add_instance()
        self.windows.add_instance()
        return self.num_instances - 1

    # ---- matching -------------------------------------------------------------------------

    def match(self, chain: array) -> Match:
        """How far the prompt's ``chain`` runs through nodes some instance holds, and its
        key portion. Read-only."""
        nodes, lengths, node, pos, n, key = [], [], self.root, 0, len(chain), None
        while pos < n and (child := node.children.get(chain[pos])) is not None:
            if not child.cached and not child.pending:
                break
            m = common_prefix(child.hashes, chain, pos)
            nodes.append(child)
            lengths.append(m)
            if m > pos:  # more pages than all before it: the key portion so far
                key = child
            pos += m
            if m < len(child.hashes):
                break
            node = child
        return Match(nodes, lengths, self.page_size, pos * self.page_size, key, windows=self.windows)

    def eviction_order(self, instance: int) -> Iterator[GlobalNode]:
        """The instance's nodes in the order its engine's LRU eviction would take them:
        least recently used first, a node only once no child it holds is left (a node
        passed while it still has one goes right after that child's turn)."""
        taken: set[GlobalNode] = set()
        waiting: set[GlobalNode] = set()

        def is_leaf(node: GlobalNode) -> bool:
            return not any(c.held_by(instance) and c not in taken for c in node.children.values())

        for node in self.lru[instance]:
            if node in taken:
                continue
            if not is_leaf(node):
                waiting.add(node)
                continue
            while True:
                taken.add(node)
                yield node
                node = node.parent
                if node not in waiting or not is_leaf(node):
                    break
                waiting.discard(node)

    def _find(self, chain) -> list[GlobalNode] | None:
        """The nodes along ``chain`` (the last may extend past its end), or None when the
        tree does not hold all of it. Read-only."""
        path, node, pos, n = [], self.root, 0, len(chain)
        while pos < n:
            child = node.children.get(chain[pos])
            if child is None:
                return None
            m = common_prefix(child.hashes, chain, pos)
            if pos + m < n and m < len(child.hashes):
                return None  # the chain branches off inside the node
            path.append(child)
            pos += m
            node = child
        return path

    def _insert(self, chain, split_end: bool) -> list[GlobalNode]:
        """The nodes along ``chain``, adding what is missing: a node the chain branches off
        inside is split there and the branch added. With ``split_end`` a node the chain
        ends inside is split there too; otherwise it is returned whole."""
        path, node, pos, n = [], self.root, 0, len(chain)
        while pos < n:
            child = node.children.get(chain[pos])
            if child is None:
                child = GlobalNode(chain[pos:] if isinstance(chain, array) else array("Q", chain[pos:]), node)
                node.children[chain[pos]] = child
                path.append(child)
                break
            m = common_prefix(child.hashes, chain, pos)
            if m < len(child.hashes) and (pos + m < n or split_end):
                child = self._split(child, m)
            path.append(child)
            pos += m
            node = child
        return path

    def _split(self, node: GlobalNode, m: int) -> GlobalNode:
        """Cut ``node`` after ``m`` pages; the new upper half inherits its requests, and each
        instance's cached pages divide between the halves."""
        upper = GlobalNode(node.hashes[:m], node.parent)
        upper.cached = {i: min(e, m) for i, e in node.cached.items()}
        upper.pending = dict(node.pending)
        upper.hits = {i: ts[:] for i, ts in node.hits.items()}
        upper.replicas = node.replicas
        node.parent.children[upper.hashes[0]] = upper
        node.hashes, node.parent = node.hashes[m:], upper
        node.cached = {i: e - m for i, e in node.cached.items() if e > m}
        upper.cached_kids = dict.fromkeys(node.cached, 1)
        upper.children[node.hashes[0]] = node
        for i in upper.holders():  # the instances whose LRU holds the node
            lru = self.lru[i]
            lru[upper] = None  # an ancestor is never older than its descendants
            if not node.held_by(i):
                del lru[node]
        self._note_unheld(node)
        return upper

    # ---- routing bookkeeping ----------------------------------------------------------------

    def route(self, chain: array, instance: int, now: float) -> GlobalNode:
        """Record that a request whose prompt has ``chain`` goes to ``instance``; return its
        end node (hand it back to ``finish``)."""
        path = self._insert(chain, split_end=True)
        lru, size = self.lru[instance], self.page_size
        for node in reversed(path):  # the root side ends up most recent
            pending = node.pending.get(instance, 0)
            if not pending:
                self.held_tokens[instance] += (len(node.hashes) - node.cached.get(instance, 0)) * size
                self.pinned_tokens[instance] += len(node.hashes) * size
            node.pending[instance] = pending + 1
            times = node.hits.get(instance)
            if times is None:
                node.hits[instance] = [now]
            else:
                times.append(now)
            if node in lru:
                lru.move_to_end(node)
            else:
                lru[node] = None
        return path[-1] if path else self.root

    def finish(self, end: GlobalNode, instance: int) -> None:
        node, lru = self.live(end), self.lru[instance]
        while node.parent is not None:
            left = node.pending[instance] - 1
            if left > 0:
                node.pending[instance] = left
            else:  # no longer in flight there
                del node.pending[instance]
                cached = node.cached.get(instance, 0)
                self.held_tokens[instance] -= (len(node.hashes) - cached) * self.page_size
                self.pinned_tokens[instance] -= len(node.hashes) * self.page_size
                if not cached:
                    lru.pop(node, None)
                    self._note_unheld(node)
            node = node.parent

    def requests_in_window(self, node: GlobalNode, instance: int, now: float) -> int:
        times = node.hits.get(instance)
        if not times:
            return 0
        horizon = now - self.window_s
        if times[0] < horizon:  # times only grow, so the expired ones lead
            del times[: bisect_left(times, horizon)]
        return len(times)

    # ---- mirroring the engines ------------------------------------------------------------

    def apply_events(self, instance: int, events: list[CacheEvent]) -> None:
        """Mirror an engine's cache (its host tier's events go to ``host``). An engine
        evicts the tails of its leaves page run by page run; here that shortens the
        instance's cached extent of a node instead of splitting it."""
        for event in events:
            if event.tier == "host":
                self.host.apply(instance, event)
            elif event.tier == "window":
                self.windows.apply(instance, event)
            elif event.kind == "stored":
                self._store(instance, event.hashes, event.start)
            else:
                self._evict(instance, event.hashes, event.start)
                self.windows.evicted(instance, event.hashes, event.start)

    def _store(self, instance: int, chain: tuple[int, ...], start: int) -> None:
        """Pages ``start`` onwards of ``chain`` are cached on ``instance`` (those before
        already were): extend the instance's extent of every node the span reaches."""
        begin, n, size = 0, len(chain), self.page_size
        for node in self._insert(chain, split_end=False):
            length = len(node.hashes)
            old, new = node.cached.get(instance, 0), min(length, n - begin)
            if begin + length > start and new > old:
                if not old:
                    kids = node.parent.cached_kids
                    kids[instance] = kids.get(instance, 0) + 1
                node.cached[instance] = new
                self.cached_tokens[instance] += (new - old) * size
                if instance not in node.pending:
                    self.held_tokens[instance] += (new - old) * size
                    self.lru[instance][node] = None
            begin += length

    def _evict(self, instance: int, chain: tuple[int, ...], start: int) -> None:
        """Pages ``start`` onwards of ``chain`` left ``instance``'s cache. The tree merges
        every engine's branches, so a node can have children another branch of this
        engine still caches: the eviction stops at such a node (deepest first)."""
        path = self._find(chain)
        if not path:
            return  # a path this tree never saw stored
        size, lru = self.page_size, self.lru[instance]
        end = sum(len(node.hashes) for node in path)
        for node in reversed(path):
            begin = end - len(node.hashes)
            end = begin
            if begin + len(node.hashes) <= start:
                break
            if instance in node.cached_kids:
                break
            old, keep = node.cached.get(instance, 0), max(0, start - begin)
            if keep >= old:
                continue
            self.cached_tokens[instance] -= (old - keep) * size
            if keep:
                node.cached[instance] = keep
            else:
                del node.cached[instance]
                kids = node.parent.cached_kids
                if kids[instance] > 1:
                    kids[instance] -= 1
                else:
                    del kids[instance]
            if instance not in node.pending:
                self.held_tokens[instance] -= (old - keep) * size
                if not keep:
                    lru.pop(node, None)
                    self._note_unheld(node)

    def cached_sequences(self, instance: int) -> set[tuple[int, ...]]:
        """Maximal cached paths of one instance, as chain hashes (comparable with an
        engine's radix cache)."""
        out, stack = set(), [(self.root, ())]
        while stack:
            node, prefix = stack.pop()
            for child in node.children.values():
                extent = child.cached.get(instance, 0)
                if not extent:
                    continue
                seq = prefix + tuple(child.hashes[:extent])
                if extent < len(child.hashes):
                    out.add(seq)
                    continue
                if instance not in child.cached_kids:
                    out.add(seq)
                stack.append((child, seq))
        return out

    # ---- forgetting -----------------------------------------------------------------------

    def forget(self, instance: int) -> None:
        """Everything ``instance`` caches is gone (its engine died): evict each maximal
        cached path; the last path through a shared node takes that node with it."""
        evicted = [CacheEvent("evicted", seq, 0) for seq in self.cached_sequences(instance)]
        self.apply_events(instance, evicted)
        self.host.forget(instance)
        self.windows.forget(instance)

    def _note_unheld(self, node: GlobalNode) -> None:
        if node.cached or node.pending:
            return
        last = max((times[-1] for times in node.hits.values() if times), default=float("-inf"))
        heapq.heappush(self._unheld, (last + self.window_s, next(self._seq), node))

    def prune(self, now: float) -> int:
        """Remove nodes that no instance holds and nobody used within the window, and merge
        a node left with one child into it when both carry the same state. Only nodes that
        lost their last holder are looked at, once their last request left the window, so
        the cost follows what changed, not the size of the tree."""
        removed, later = 0, []
        while self._unheld and self._unheld[0][0] < now:  # a request at t counts until t + W
            _, _, node = heapq.heappop(self._unheld)
            while (
                node.parent is not None
                and node.parent.children.get(node.hashes[0]) is node  # still in the tree
                and not node.children
                and not node.cached
                and not node.pending
            ):
                if any(self.requests_in_window(node, i, now) for i in list(node.hits)):
                    later.append(node)  # used since: look again when that leaves the window
                    break
                parent = node.parent
                del parent.children[node.hashes[0]]
                node.parent = None
                removed += 1
                if parent is self.root:
                    break
                if len(parent.children) == 1:
                    child = next(iter(parent.children.values()))
                    if self._same_state(parent, child, now):
                        self._merge(parent, child)
                        removed += 1
                node = parent
        for node in later:
            self._note_unheld(node)
        return removed

    def _same_state(self, a: GlobalNode, b: GlobalNode, now: float) -> bool:
        """Whether child ``b`` can fold into ``a``: the same requests, and every instance's
        cached pages still one run from the start of ``a``."""
        if a.pending != b.pending or a.replicas != b.replicas:
            return False
        if any(i not in a.cached or a.cached[i] < len(a.hashes) for i in b.cached):
            return False
        instances = set(a.hits) | set(b.hits)
        return all(
            self.requests_in_window(a, i, now) == self.requests_in_window(b, i, now) for i in instances
        )

    @staticmethod
    def live(node: GlobalNode) -> GlobalNode:
        """The node that now holds ``node``'s pages at the same depth: ``node`` itself, or
        the node it was merged into (a request in flight keeps its end node across a
        prune)."""
        while node.merged is not None:
            node = node.merged
        return node

    def _merge(self, node: GlobalNode, child: GlobalNode) -> None:
        """Fold ``child`` into ``node`` (its only child, same state); requests in flight
        that end at ``child`` end at ``node`` now."""
        del node.children[child.hashes[0]]
        node.hashes = node.hashes + child.hashes
        for i, extent in child.cached.items():
            node.cached[i] += extent
        node.children, node.cached_kids = child.children, child.cached_kids
        for grandchild in node.children.values():
            grandchild.parent = node
        child.parent, child.merged = None, node
        for lru in self.lru:
            lru.pop(child, None)

    def num_nodes(self) -> int:
        count, stack = 0, list(self.root.children.values())
        while stack:
            node = stack.pop()
            count += 1
            stack.extend(node.children.values())
        return count
