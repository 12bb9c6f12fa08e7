"""Algorithm 2 (LOADCOST): the cost of sending a request to an instance is L + M + P.

- ``L``: the instance's load. As Algorithm 2 prices it (``InstanceHistory.load``), Σ over
  its requests of PREFILLTIME(their missed tokens) + DECODETIME(the average decoding
  length in W); as a batching engine pays it (``batch_load``, E2's default), what its
  batch adds to the request's latency and the request adds to the batch's. Kept as
  running sums, so reading it is O(1) (the paper's scalable realization).
- ``M``: what the instance would have to evict to make room for this request's missed
  tokens, found by a virtual LRU eviction over the global tree; each evicted node costs
  PREFILLTIME(its tokens) × the requests that used it there within W (Algorithm 2), or,
  under the batch load model, one PREFILLTIME for a node used within W.
- ``P``: PREFILLTIME(this request's missed tokens on that instance) (the reference code
  leaves ``P`` out; we don't); under the batch model paid also by each request decoding
  beside it (``InstanceHistory.decoding``).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

from preble_backend.common.cost_model import CostModel
from scheduler.global_tree import GlobalPrefixTree
from scheduler.tree_node import Match


class DecodeLengths:
    """The average decoding length in H (Algorithm 2: ``decode_len`` ← average decoding
    length in H): over the requests that finished within the window on any instance. The
    paper's reason for using an average at all is that output lengths are "small and
    similar across a workload", a property of the requests and not of the GPU that ran
    them; a per-instance average is one or two samples on an instance that has just started
    to serve, and one 1-token answer then makes that instance look 30× lighter than the
    rest, so every exploring request piles onto it."""

    def __init__(self, window_s: float, default: float) -> None:
        self.window_s = window_s
        self.default = default  # before any request has finished
        self.finished: deque[tuple[float, int]] = deque()  # (time, output tokens)
        self.total = 0

    def add(self, now: float, output_tokens: int) -> None:
        self.finished.append((now, output_tokens))
        self.total += output_tokens

    def average(self, now: float) -> float:
        horizon = now - self.window_s
        while self.finished and self.finished[0][0] < horizon:
            self.total -= self.finished.popleft()[1]
        return self.total / len(self.finished) if self.finished else self.default


class InstanceHistory:
    """One instance's requests within the window and its requests in flight; every sum is
    kept running, so reading a load is O(1). Entries are tuples of numbers: the garbage
    collector stops tracking those after one look, and the window holds thousands."""

    def __init__(self, window_s: float) -> None:
        self.window_s = window_s
        # (time, prefill ms, the tokens it prefills, those it loads from the host tier)
        self.routed: deque[tuple[float, float, int, int]] = deque()
        self.prefill_ms = 0.0
        # id -> (prefill ms, cached share, tokens, whether it decodes, prefilled, loaded)
        self.in_flight: dict[str, tuple[float, float, int, bool, int, int]] = {}
        self.in_flight_prefill_ms = 0.0
        self.in_flight_legs, self.legs_prefill_ms = 0, 0.0  # those that leave after one token, their prefill
        self.in_flight_cached = 0.0  # Σ cached fraction
        self.in_flight_tokens = 0  # Σ prompt tokens: what the batch's attention reads
        self.backlog_ms, self.backlog_at = 0.0, 0.0  # prefill still queued, as of a time

    def add(self, request_id: str, now: float, prefill_ms: float, cached: float, tokens: int,
            decodes: bool = True, work: tuple[int, int] = (0, 0)) -> None:  # fmt: skip
        """A request routed here: its prefill time, the fraction of its prompt cached, its
        prompt's length, whether it decodes here (not a prefill leg that leaves after one
        token, ``disagg.py``), and the work its prefill time prices (tokens prefilled,
        tokens loaded from the host tier), for ``reprice``."""
        queued = self.queued_prefill(now)  # capped by what was in flight before this request
        self.routed.append((now, prefill_ms, *work))
        self.prefill_ms += prefill_ms
        self.in_flight[request_id] = (prefill_ms, cached, tokens, decodes, *work)
        self.in_flight_prefill_ms += prefill_ms
        if not decodes:
            self.in_flight_legs += 1
            self.legs_prefill_ms += prefill_ms
        self.in_flight_cached += cached
        self.in_flight_tokens += tokens
        self.backlog_ms, self.backlog_at = queued + prefill_ms, now

    def queued_prefill(self, now: float) -> float:
        """The prefill still queued ahead of a new request (ms): what was routed here,
        drained at one millisecond of prefill per millisecond since, and never more than
        the requests in flight brought. A request already decoding has had its prefill: a
        sum over the batch counted it as if it had not."""
        drained = self.backlog_ms - (now - self.backlog_at) * 1000.0
        return min(max(0.0, self.in_flight_prefill_ms), max(0.0, drained))

    def finish(self, request_id: str) -> None:
        entry = self.in_flight.pop(request_id, None)
        if entry is not None:
            self.in_flight_prefill_ms -= entry[0]
            self.in_flight_cached -= entry[1]
            self.in_flight_tokens -= entry[2]
            if not entry[3]:
                self.in_flight_legs -= 1
                self.legs_prefill_ms -= entry[0]
        if not self.in_flight:  # no rounding drift survives an idle moment
            self.in_flight_prefill_ms = self.in_flight_cached = self.backlog_ms = self.legs_prefill_ms = 0.0

    def reprice(self, price: Callable[[int, int], float]) -> None:
        """The instance's cost model changed (learnt online): every prefill in the window
        and in flight at the new ``price(prefilled, loaded)``. Kept at the price of their
        routing, a prior's milliseconds weighed for the whole window (180 s) beside the
        learnt fit's: tiny engines started from SmolLM2's fit (10x their cost) were priced
        by the instances' first seconds for the rest of the trace."""
        self.routed = deque((t, price(m, h), m, h) for t, _, m, h in self.routed)
        self.prefill_ms = sum(entry[1] for entry in self.routed)
        before = self.in_flight_prefill_ms
        self.in_flight = {rid: (price(m, h), *rest, m, h) for rid, (_, *rest, m, h) in self.in_flight.items()}
        self.in_flight_prefill_ms = sum(entry[0] for entry in self.in_flight.values())
        self.legs_prefill_ms = sum(entry[0] for entry in self.in_flight.values() if not entry[3])
        if before > 0:  # the backlog drains as it did, at the new price
            self.backlog_ms *= self.in_flight_prefill_ms / before

    def routed_in_window(self, now: float) -> int:
        self._expire(now)
        return len(self.routed)

    def _expire(self, now: float) -> None:
        horizon = now - self.window_s
        while self.routed and self.routed[0][0] < horizon:
            self.prefill_ms -= self.routed.popleft()[1]

    def load(self, now: float, decode_ms: float, signal: str = "history") -> float:
        """L of Algorithm 2, in milliseconds, each request counted as its prefill time plus
        ``decode_ms`` (DECODETIME of the average decoding length): over the requests routed
        within the window (``history``, as Algorithm 2 reads), or over those still in
        flight (``in_flight``, the current load the paper's realization keeps up to date on
        every assignment and completion)."""
        self._expire(now)
        if signal == "in_flight":
            return self.in_flight_prefill_ms + len(self.in_flight) * decode_ms
        return max(0.0, self.prefill_ms) + len(self.routed) * decode_ms

    def prefill_share(self, now: float, extra_ms: float = 0.0) -> float:
        """The share of the instance's time the prefills routed here within the window take,
        with ``extra_ms`` more: over the time since the oldest of them (at least 1 s)."""
        self._expire(now)
        span_ms = 1000.0 * max(1.0, now - self.routed[0][0]) if self.routed else 1000.0
        return (max(0.0, self.prefill_ms) + extra_ms) / span_ms

    @property
    def decoders(self) -> int:
        """The requests in flight that decode here: all but prefill legs."""
        return len(self.in_flight) - self.in_flight_legs

    def decoding(self, decode_ms: float) -> float:
        """How many of the requests in flight are decoding rather than waiting for their
        prefill, expected from the shares of a request's time the two take: its prefill
        (the mean in flight) and ``decode_ms``. Prefill legs never decode."""
        b = self.decoders
        if b <= 0 or decode_ms <= 0:
            return 0.0
        return b * decode_ms / (decode_ms + max(0.0, self.in_flight_prefill_ms - self.legs_prefill_ms) / b)

    def queued(self, decode_len: float, prompt_len: int, capacity: int) -> float:
        """How many requests a new one of ``prompt_len`` tokens would wait behind: those in
        flight (at their mean KV, prompt plus ``decode_len``) beyond what ``capacity``
        holds with it."""
        b = len(self.in_flight)
        if not b:
            return 0.0
        per_request = (self.in_flight_tokens + b * decode_len) / b
        return max(0.0, b - (capacity - prompt_len - decode_len) / per_request)

    def decode_ratio(self) -> float:
        """How decode-heavy the in-flight requests are: the mean cached fraction of their
        prompts (a fully cached prompt is a pure decoding unit, §4.2)."""
        if not self.in_flight:
            return 0.0
        return self.in_flight_cached / len(self.in_flight)


def batch_load(
    history: InstanceHistory,
    cost: CostModel,
    decode_len: float,
    prompt_len: int,
    capacity: int,
    queued_ms: float,
    batch_kv: int,
    new_kv: int,
) -> float:
    """L for engines that batch (continuous batching, chunked prefill): the time the
    instance's requests in flight add to this request plus the time it adds to them, from
    the cost model's iteration time. Algorithm 2's DECODETIME per request in flight prices
    each one as if it ran alone after the others (seconds each), while in a batch another
    request lengthens each iteration by its share (``decode_ms_per_request`` plus the
    attention over its context); pricing load that way put it 20-30x above the recompute it
    is weighed against, and chat turns left their cached conversations (docs/SCHEDULER.md).
    Terms, in milliseconds, with ``b`` requests in flight whose contexts sum to ``ctx``
    tokens at the window's average decoding length ``d``:

    - the prefill queued ahead, ``queued_ms``;
    - its ``d`` iterations, each lengthened by the batch: ``b · decode + attention · ctx``;
    - the batch's iterations it lengthens: ``b`` requests over ``d / 2`` steps on average;
    - when the KV would overflow ``capacity``, the wait for as much of the batch to finish:
      the batch holds ``batch_kv`` prompt tokens plus ``b · d``, and the request adds
      ``new_kv`` plus ``d``. The caller says how it counts them (``E2._batch_load``).
    """
    b = len(history.in_flight)
    if not b:
        return 0.0
    ctx = history.in_flight_tokens + b * decode_len
    batch_step = b * cost.decode_ms_per_request + cost.attention_ms_per_context_token * ctx
    own_step = cost.decode_ms_per_request + cost.attention_ms_per_context_token * (prompt_len + decode_len)
    load = queued_ms + decode_len * batch_step + b * decode_len / 2 * own_step
    kv = batch_kv + b * decode_len
    over = kv + new_kv + decode_len - capacity
    if over > 0:
        load += min(1.0, over / kv) * decode_len * (cost.base_ms + batch_step)
    return load


def memory_cost(
    tree: GlobalPrefixTree,
    instance: int,
    need: int,
    match: Match,
    now: float,
    cost: CostModel,
    host: set[int] | None = None,
    per_user: bool = True,
) -> float:
    """M of Algorithm 2: the recompute cost of what an LRU eviction on ``instance`` would
    remove to free ``need`` tokens. Each evicted node costs PREFILLTIME(its tokens) × the
    requests that used it there within W, or (``per_user`` false, the batch load model's
    reading) PREFILLTIME(its tokens) once if any did: the next request that wants it
    recomputes it and those after it hit again, and L and P are then one request's cost,
    not a window's (docs/SCHEDULER.md, "M under the batch load model"). Two kinds of node
    are never evicted, as in the engine: those this request reuses (its matched path) and
    those requests still running there hold (the engine locks them). Both are closed
    towards the root (a request holds its whole path), so skipping them leaves the order
    of the rest unchanged. Walked afresh per request, and only when the request does not
    fit: the walk stops as soon as enough is freed, so it visits the oldest few nodes. On
    an engine with a host tier (``host``: the chain hashes of its host pages, as the router
    mirrors them) what the device evicts moves down and comes back by a load-back, so a
    node costs its load-back time instead, and every evicted page the host does not hold
    yet costs its copy down, used or not: the engine waits for each offload (ours, with
    the tiers)."""
    price = cost.prefill_time if host is None else cost.load_time
    reused = set(match.nodes)
    freed, spent = 0, 0.0
    for node in tree.eviction_order(instance):
        if freed >= need:
            break
        if node in reused or instance in node.pending:
            continue
        pages = node.held_pages(instance)
        tokens = pages * tree.page_size
        users = tree.requests_in_window(node, instance, now)
        if users:
            spent += price(tokens) * (users if per_user else 1)
        if host is not None:
            copied = sum(1 for h in node.hashes[:pages] if h not in host)
            spent += cost.load_time(copied * tree.page_size)
        freed += tokens
    return spent
