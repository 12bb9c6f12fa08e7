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

from collections import deque
from dataclasses import dataclass

from scheduler.cost_model import CostModel
from scheduler.global_tree import GlobalPrefixTree, Match


@dataclass
class Routed:
    """A request in an instance's history window."""

    time: float
    prefill_ms: float
    cached_fraction: float


class InstanceHistory:
    """One instance's requests within the window, and their decode lengths."""

    def __init__(self, window_s: float, default_decode_len: float) -> None:
        self.window_s = window_s
        self.default_decode_len = default_decode_len
        self.routed: deque[Routed] = deque()
        self.prefill_ms = 0.0
        self.decoded: deque[tuple[float, int]] = deque()
        self.decoded_sum = 0
        self.in_flight: dict[str, Routed] = {}

    def expire(self, now: float) -> None:
        horizon = now - self.window_s
        while self.routed and self.routed[0].time < horizon:
            self.prefill_ms -= self.routed.popleft().prefill_ms
        while self.decoded and self.decoded[0][0] < horizon:
            self.decoded_sum -= self.decoded.popleft()[1]

    def add(self, request_id: str, entry: Routed) -> None:
        self.routed.append(entry)
        self.prefill_ms += entry.prefill_ms
        self.in_flight[request_id] = entry

    def finish(self, request_id: str, now: float, output_tokens: int) -> None:
        self.in_flight.pop(request_id, None)
        self.decoded.append((now, output_tokens))
        self.decoded_sum += output_tokens

    def avg_decode_len(self) -> float:
        return self.decoded_sum / len(self.decoded) if self.decoded else self.default_decode_len

    def load(self, cost: CostModel, now: float, signal: str = "history") -> float:
        """L of Algorithm 2, in milliseconds: over the requests routed within the window
        (``history``, as Algorithm 2 reads), or over those still in flight (``in_flight``,
        the current load the paper's realization keeps up to date on every assignment and
        completion)."""
        self.expire(now)
        decode = cost.decode_time(self.avg_decode_len())
        if signal == "in_flight":
            return sum(r.prefill_ms for r in self.in_flight.values()) + len(self.in_flight) * decode
        return max(0.0, self.prefill_ms) + len(self.routed) * decode

    def decode_ratio(self) -> float:
        """How decode-heavy the in-flight requests are: the mean cached fraction of their
        prompts (a fully cached prompt is a pure decoding unit, §4.2)."""
        if not self.in_flight:
            return 0.0
        return sum(r.cached_fraction for r in self.in_flight.values()) / len(self.in_flight)


def memory_cost(
    tree: GlobalPrefixTree,
    instance: int,
    match: Match,
    missed: int,
    capacity: int,
    cost: CostModel,
    now: float,
) -> float:
    """M of Algorithm 2: recompute cost of what a virtual LRU eviction would remove."""
    need = tree.held_tokens[instance] + missed - capacity
    if need <= 0:
        return 0.0
    keep = {id(n) for n in match.nodes}
    gone: set[int] = set()
    freed, total = 0, 0.0
    for node in tree.lru[instance].values():  # oldest first; ancestors come after descendants
        if freed >= need:
            break
        if id(node) in keep or any(c.held_by(instance) and id(c) not in gone for c in node.children.values()):
            continue
        gone.add(id(node))
        freed += len(node.key)
        users = tree.requests_in_window(node, instance, now)
        if users:
            total += cost.prefill_time(len(node.key)) * users
    return total
