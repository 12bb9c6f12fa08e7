"""Algorithm 2 (LOADCOST): the cost of sending a request to an instance is L + M + P.

- ``L``: the instance's load, Σ over requests routed to it within the window W of
  PREFILLTIME(their missed tokens) + DECODETIME(the instance's average decode length).
  Kept as running sums, so reading it is O(1) (the paper's scalable realization).
- ``M``: what the instance would have to evict to make room for this request's missed
  tokens, found by a virtual LRU eviction over the global tree; each evicted node costs
  PREFILLTIME(its tokens) × the requests that used it there within W.
- ``P``: PREFILLTIME(this request's missed tokens on that instance). (The reference code
  leaves ``P`` out; we don't.)
"""

from __future__ import annotations

import itertools
from bisect import bisect_left
from collections import deque

from scheduler.cost_model import CostModel
from scheduler.global_tree import GlobalPrefixTree
from scheduler.tree_node import GlobalNode, Match


class InstanceHistory:
    """One instance's requests within the window, its requests in flight, and their decode
    lengths; every sum is kept running, so reading a load is O(1). Entries are tuples of
    numbers: the garbage collector stops tracking those after one look, and the window
    holds thousands."""

    def __init__(self, window_s: float, default_decode_len: float, cost: CostModel) -> None:
        self.window_s = window_s
        self.default_decode_len = default_decode_len
        self.cost = cost
        self.decode_ms = cost.decode_time(default_decode_len)  # DECODETIME(average decode length)
        self.routed: deque[tuple[float, float]] = deque()  # (time, prefill ms)
        self.prefill_ms = 0.0
        self.decoded: deque[tuple[float, int]] = deque()  # (time, output tokens)
        self.decoded_sum = 0
        self.in_flight: dict[str, tuple[float, float]] = {}  # id -> (prefill ms, cached fraction)
        self.in_flight_prefill_ms = 0.0
        self.in_flight_cached = 0.0  # Σ cached fraction

    def expire(self, now: float) -> None:
        horizon = now - self.window_s
        while self.routed and self.routed[0][0] < horizon:
            self.prefill_ms -= self.routed.popleft()[1]
        while self.decoded and self.decoded[0][0] < horizon:
            self.decoded_sum -= self.decoded.popleft()[1]
        self.decode_ms = self.cost.decode_time(self.avg_decode_len())

    def add(self, request_id: str, now: float, prefill_ms: float, cached_fraction: float) -> None:
        """A request routed here: its prefill time and the fraction of its prompt cached."""
        self.routed.append((now, prefill_ms))
        self.prefill_ms += prefill_ms
        self.in_flight[request_id] = (prefill_ms, cached_fraction)
        self.in_flight_prefill_ms += prefill_ms
        self.in_flight_cached += cached_fraction

    def finish(self, request_id: str, now: float, output_tokens: int) -> None:
        entry = self.in_flight.pop(request_id, None)
        if entry is not None:
            self.in_flight_prefill_ms -= entry[0]
            self.in_flight_cached -= entry[1]
        if not self.in_flight:  # no rounding drift survives an idle moment
            self.in_flight_prefill_ms = self.in_flight_cached = 0.0
        self.decoded.append((now, output_tokens))
        self.decoded_sum += output_tokens
        self.decode_ms = self.cost.decode_time(self.avg_decode_len())

    def avg_decode_len(self) -> float:
        return self.decoded_sum / len(self.decoded) if self.decoded else self.default_decode_len

    def load(self, now: float, signal: str = "history") -> float:
        """L of Algorithm 2, in milliseconds: over the requests routed within the window
        (``history``, as Algorithm 2 reads), or over those still in flight (``in_flight``,
        the current load the paper's realization keeps up to date on every assignment and
        completion)."""
        horizon = now - self.window_s
        if (self.routed and self.routed[0][0] < horizon) or (self.decoded and self.decoded[0][0] < horizon):
            self.expire(now)
        if signal == "in_flight":
            return self.in_flight_prefill_ms + len(self.in_flight) * self.decode_ms
        return max(0.0, self.prefill_ms) + len(self.routed) * self.decode_ms

    def decode_ratio(self) -> float:
        """How decode-heavy the in-flight requests are: the mean cached fraction of their
        prompts (a fully cached prompt is a pure decoding unit, §4.2)."""
        if not self.in_flight:
            return 0.0
        return self.in_flight_cached / len(self.in_flight)


class VirtualEviction:
    """M of Algorithm 2 for one instance: the recompute cost of what an LRU eviction there
    would remove to make room.

    The eviction order is the engines' (least recently used leaf first; a node becomes a
    leaf when its last held child goes) and is built lazily, as far as a question needs,
    with running sums of freed tokens and cost. The walk is kept while the changes the
    tree reports (``watch``) stay outside the part already walked, and until a request
    counted in it leaves the window: the engines evict the old end of the order while
    routing and storing touch the new end, so many requests share one walk. Nodes the
    new request reuses (its matched path) are never evicted; they are an ancestor chain,
    so skipping them leaves the order of the rest unchanged, and their tokens and cost
    are taken back out of the sums.
    """

    def __init__(self, tree: GlobalPrefixTree, instance: int, cost: CostModel) -> None:
        self.tree, self.instance, self.cost = tree, instance, cost
        self.changed: set[GlobalNode] = set()  # what the tree reports (watch)
        self.shape: int | None = None  # the tree's shape the walk was made in

    def _reset(self, now: float) -> None:
        self.shape = self.tree.shape
        self.changed.clear()
        self.tree.watch(self.instance, self.changed)
        self.now = now
        self.valid_until = float("inf")
        self.order: dict[GlobalNode, int] = {}  # node -> its place in the eviction order
        self.freed: list[int] = []  # tokens freed after evicting order[0..k]
        self.spent: list[float] = []  # their recompute cost
        self.parked: set[GlobalNode] = set()  # passed while a held child remained
        self.lru_walk = iter(self.tree.lru[self.instance])
        self.exhausted = False

    def _catch_up(self, now: float) -> None:
        """Keep the walk if no change reached it: a changed node it has not passed (and
        whose parent it has not passed: a new or dropped child changes when the parent
        is a leaf) sits after everything it has passed in the LRU, so the walk resumes
        where it stopped."""
        if (
            self.shape != self.tree.shape  # (also before the first walk)
            or now >= self.valid_until
            or not self.tree.watching(self.instance, self.changed)  # too much changed to sift
        ):
            return self._reset(now)
        if not self.changed:
            return
        seen, parked = self.order, self.parked
        for node in self.changed:
            if node in seen or node in parked or node.parent in seen or node.parent in parked:
                return self._reset(now)
        self.changed.clear()
        passed = len(seen) + len(parked)  # the LRU's oldest nodes, in order, are these
        self.lru_walk = itertools.islice(iter(self.tree.lru[self.instance]), passed, None)
        self.exhausted = False

    def _emit(self, node: GlobalNode) -> None:
        tree, i = self.tree, self.instance
        tokens = node.held_pages(i) * tree.page_size
        users = tree.requests_in_window(node, i, self.now)
        spent = self.cost.prefill_time(tokens) * users if users else 0.0
        if users:
            self.valid_until = min(self.valid_until, node.hits[i][0] + tree.window_s)
        self.order[node] = len(self.freed)
        self.freed.append((self.freed[-1] if self.freed else 0) + tokens)
        self.spent.append((self.spent[-1] if self.spent else 0.0) + spent)

    def _has_held_child(self, node: GlobalNode) -> bool:
        i, order = self.instance, self.order
        return any(c.held_by(i) and c not in order for c in node.children.values())

    def _extend(self, tokens: int) -> None:
        """Walk the LRU until ``tokens`` are freed or nothing is left."""
        while not self.exhausted and (not self.freed or self.freed[-1] < tokens):
            node = next(self.lru_walk, None)
            if node is None:
                self.exhausted = True
            elif node not in self.order:
                if self._has_held_child(node):
                    self.parked.add(node)
                    continue
                self._emit(node)
                parent = node.parent
                while parent in self.parked and not self._has_held_child(parent):
                    self.parked.discard(parent)  # older than where the walk is: goes next
                    self._emit(parent)
                    parent = parent.parent

    def __call__(self, need: int, match: Match, now: float) -> float:
        if need <= 0:
            return 0.0
        self._catch_up(now)
        self.now = now  # what the walk adds from here is counted as of now
        extra = 0
        while True:  # the kept nodes inside the evicted run free nothing: evict further
            self._extend(need + extra)
            k = min(bisect_left(self.freed, need + extra), len(self.freed) - 1)
            kept = [p for node in match.nodes if (p := self.order.get(node)) is not None and p <= k]
            more = sum(self.freed[p] - (self.freed[p - 1] if p else 0) for p in kept)
            if more == extra:
                break
            extra = more
        if k < 0:
            return 0.0
        return self.spent[k] - sum(self.spent[p] - (self.spent[p - 1] if p else 0.0) for p in kept)
