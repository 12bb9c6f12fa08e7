"""E2: Exploitation + Exploration (paper §4.2, Algorithms 1 and 2), with post-assignment
rebalancing and prefix autoscaling.

Per request:
1. Match the prompt in the global prefix tree.
2. **Exploit** when more prompt tokens are cached somewhere than missing: among the
   instances holding the key portion (and its autoscaled replicas), the lowest L + M + P.
   **Rebalance**: if that choice is the most loaded instance and its load exceeds
   ``Th_bal`` × the lightest instance's, the request goes to the lightest instead — but
   only while the heavy instance has requests in flight and the move pays for the
   recompute it costs (by the load model, below): a short history makes the ratio noisy,
   and an idle holder of the prefix serves it best.
3. **Explore** otherwise: the lowest L + M + P over all instances. Prefill/decode
   balancing (an instance whose in-flight work is decode-heavy, mean cached fraction
   above ``decode_ratio_threshold``, takes the prefill-heavy request first) is off by
   default: in the simulator it never helped and cost up to 7% on the embodied agent
   (docs/SCHEDULER.md gives the measurements and why).
4. **Autoscale**: when every instance serving a key portion would queue its next request
   behind ``hot_queue`` requests its KV cannot hold (and the would-be replica would not),
   when the time to first token of its requests doubles over the window, or when it is
   *too hot for its holders* (more of the window's requests than its holders' share of
   the cluster, while each holder carries over ``hot_load_factor`` × the mean load), the
   least loaded instance that lacks it becomes a replica; its exploiting requests then
   split over the holders and replicas by load cost. The replicas retire when it cools
   (its holders' share carries it again). And while it is hot, the request itself makes
   a replica where that is cheaper than its holder once the recompute is shared by the
   requests that would follow it there (``autoscale.py``).

Each instance is priced with its own cost model (``calibrated.py``): fixed, or learnt
online from its engine's pass reports (``cost_model: auto``, the router's default).

The load model: ``batch`` (the default) prices L and P as a batching engine pays them
(``load_cost.batch_load``), so load and recompute are weighed on one scale; ``serial`` is
Algorithm 2's DECODETIME per request in flight (docs/SCHEDULER.md has both and why).
"""

from __future__ import annotations

import functools
import logging
import math
import time
from collections.abc import Callable

from preble_backend.common.cost_model import CostModel
from preble_backend.common.settings import DEFAULT_PAGE_SIZE
from scheduler.autoscale import Autoscaling
from scheduler.calibrated import Calibrated
from scheduler.global_tree import GlobalPrefixTree
from scheduler.load_cost import DecodeLengths, InstanceHistory, batch_load, memory_cost
from scheduler.policy import Decision, FinishInfo, InstanceLoad, MirrorsCaches, Policy, RoutingRequest
from scheduler.tree_node import GlobalNode, Match

log = logging.getLogger("preble.e2")


class E2(Calibrated, Autoscaling, MirrorsCaches, Policy):
    name = "e2"

    def __init__(
        self,
        num_instances: int,
        cost_model: CostModel | list[CostModel] | str = "tiny_cpu",
        capacity_tokens: int | list[int] = 32768,
        window_s: float = 180.0,
        th_bal: float = 3.0,
        decode_ratio_threshold: float | None = None,
        min_decode_units: int = 2,
        default_decode_len: float = 32.0,
        autoscale_min_samples: int = 4,
        hot_min_requests: int = 16,
        hot_load_factor: float = 1.5,
        hot_queue: float | None = 1.0,
        prune_every: int = 200,
        page_size: int = DEFAULT_PAGE_SIZE,
        load_signal: str = "in_flight",
        rebalance_signal: str = "history",
        load_model: str = "batch",
        amortized_replicas: bool = True,
        clock: Callable[[], float] = time.monotonic,
        calibrate: bool = False,
        calibration_window: float = 2000.0,
    ) -> None:
        super().__init__(num_instances, clock)
        self._init_costs(num_instances, cost_model, calibrate, calibration_window)
        caps = capacity_tokens if isinstance(capacity_tokens, list) else [capacity_tokens] * num_instances
        self.capacity = list(caps)
        self.tiered = [False] * num_instances  # the engine reported a host tier
        # a joining engine's, until it reports its own
        fallback = capacity_tokens if isinstance(capacity_tokens, int) else 32768
        self.default_capacity = min(caps, default=fallback)
        self.page_size = page_size  # the engines' KV page size: prompts are hashed per page
        self.tree = GlobalPrefixTree(num_instances, window_s, page_size)
        self.history = [InstanceHistory(window_s) for _ in range(num_instances)]
        self.decode_lengths = DecodeLengths(window_s, default_decode_len)
        self.th_bal = th_bal
        self.decode_ratio_threshold = decode_ratio_threshold
        self.min_decode_units = min_decode_units
        self.autoscale_min_samples = autoscale_min_samples
        self.hot_min_requests = hot_min_requests
        self.hot_load_factor = hot_load_factor
        self.hot_queue = hot_queue
        self.prune_every = prune_every
        for key, value in (("load_signal", load_signal), ("rebalance_signal", rebalance_signal)):
            if value not in ("history", "in_flight"):
                raise ValueError(f"{key}={value!r} is invalid: expected history or in_flight")
        if load_model not in ("batch", "serial"):
            raise ValueError(f"load_model={load_model!r} is invalid: expected batch or serial")
        self.load_signal = load_signal
        self.load_model = load_model
        self.rebalance_signal = rebalance_signal
        self.amortized_replicas = amortized_replicas
        self._routed: dict[str, tuple[GlobalNode, GlobalNode | None]] = {}  # id -> (end, key portion)
        self._next = 0  # where round-robin tie-breaking starts
        self._decisions = 0
        self._page_size_warned = False

    # ---- Algorithm 1 ----------------------------------------------------------------------

    def select(self, request: RoutingRequest, loads: list[InstanceLoad]) -> Decision:
        self.reprice()
        now = self.clock()
        match = self.tree.match(request.chain(self.page_size))
        decision = self.choose(request, loads, match, now)
        self._record(request, decision.instance, match, now)
        return decision

    def choose(
        self, request: RoutingRequest, loads: list[InstanceLoad], match: Match, now: float
    ) -> Decision:
        """Algorithm 1's choice among the live instances, not yet recorded."""
        prompt_len = len(request.input_ids)
        chain = request.chain(self.page_size)
        reach = self._host_reach(match, chain) if self.tree.host.total else {}
        cached = max(match.matched, *reach.values()) if reach else match.matched
        missed = prompt_len - cached
        holders = self._key_holders(match) if cached > missed else set()
        if reach:
            holders |= {i for i, tokens in reach.items() if tokens > prompt_len - tokens}
        if holders and match.key is not None and self._queued_everywhere(match.key, holders, prompt_len, now):
            self._replicate(match.key, now)  # (a prefix only host tiers hold has no key portion)
            holders |= self._key_holders(match)
        if holders:  # exploit: among the instances holding the key portion
            choice = self._cheapest(holders, match, prompt_len, loads, now)
            lighter = self._rebalance_target(choice, match, prompt_len, loads, now)
            if lighter is not None:
                decision = Decision(lighter, "rebalance")
            elif (replica := self._replica_that_pays(match, choice, prompt_len, now)) is not None:
                self._replicate(match.key, now, replica)
                decision = Decision(replica, "replicate")
            else:
                decision = Decision(choice, "exploit")
        else:  # explore
            decode_heavy = self._decode_heavy_instance()
            if decode_heavy is not None:
                decision = Decision(decode_heavy, "explore_decode_balance")
            else:
                decision = Decision(self._cheapest(self.live, match, prompt_len, loads, now), "explore")
        return decision

    def _host_reach(self, match: Match, chain) -> dict[int, int]:
        """Tiers (ours, after HiCache-aware routers): for each live instance whose host tier
        continues the prompt past its device, how far both reach (tokens); its host pages
        are noted in ``match.hosted`` for the load cost. Empty without host tiers."""
        reach, match.hosted = {}, {}
        for i in self.tree.host.holders():
            if i in self.live:
                device = match.cached_on(i)
                hosted = self.tree.host.run(i, chain, device // self.page_size)
                if hosted:
                    match.hosted[i] = hosted
                    reach[i] = device + hosted * self.page_size
        return reach

    def _key_holders(self, match: Match) -> set[int]:
        """The live instances that hold the prompt's key portion, and the autoscaled
        replicas of any node on its path."""
        if match.key is None:
            return set()
        holders = match.key.holders()
        for node in match.nodes:
            holders |= node.replicas
        return holders & self.live

    def _cheapest(self, candidates: set[int], match: Match, prompt_len: int, loads, now: float) -> int:
        """Lowest L + M + P; equal costs go to the less busy GPU (NVML), then round-robin
        from the last choice, so an idle cluster spreads work (and cache) instead of piling
        it on instance 0. A single candidate needs no costing (and moves no round-robin)."""
        if len(candidates) == 1:
            return next(iter(candidates))
        start, n = self._next, self.num_instances

        def rank(i: int) -> tuple:
            return self.load_cost(i, match, prompt_len, now), _busy(loads, i), (i - start) % n

        best = min(candidates, key=rank)
        self._agrees(best, candidates, rank)
        self._next = (best + 1) % n
        return best

    def _rebalance_target(self, choice: int, match: Match, prompt_len: int, loads, now: float) -> int | None:
        """Post-assignment rebalancing (§4.2): when the choice is the most loaded instance
        (alone or tied) and its load exceeds ``th_bal`` × the lightest's, the request goes
        to the lightest. Two guards of ours: only a choice with requests in flight
        (nothing queues on an idle one, so its cache serves best), and only when the move
        pays for the cached tokens it throws away: under the ``batch`` load model, when the
        lightest's L + M + P is below the choice's (one scale for load and recompute);
        under ``serial``, when the load gap exceeds the recompute."""
        if self.th_bal == math.inf or not self.history[choice].in_flight:
            return None
        load = {i: self.load(i, now, self.rebalance_signal) for i in self.live}
        heaviest = max(load.values())
        lightest = min(self.live, key=lambda i: (load[i], _busy(loads, i), i))
        if load[choice] != heaviest or lightest == choice or load[choice] <= self.th_bal * load[lightest]:
            return None
        if self.load_model == "batch":
            cost = functools.partial(self.load_cost, match=match, prompt_len=prompt_len, now=now)
            return lightest if cost(lightest) < cost(choice) else None
        gap = load[choice] - load[lightest]
        recompute = self.costs[choice].prefill_time(match.cached_on(choice))
        return lightest if gap > recompute else None

    def _decode_heavy_instance(self) -> int | None:
        """Explore's first rule when enabled: an instance whose in-flight requests are
        mostly decoding (mean cached fraction above the threshold) takes the prefill-heavy
        request."""
        if self.decode_ratio_threshold is None:
            return None
        ratios = {}
        for i in sorted(self.live):
            h = self.history[i]
            ratios[i] = h.decode_ratio() if len(h.in_flight) >= self.min_decode_units else 0.0
        best = max(ratios, key=lambda i: ratios[i])
        return best if ratios[best] > self.decode_ratio_threshold else None

    # ---- Algorithm 2 ----------------------------------------------------------------------

    def load(self, instance: int, now: float, signal: str) -> float:
        """L: the instance's load, each request's decoding counted as DECODETIME(the
        average decoding length in the window)."""
        decode_ms = self.costs[instance].decode_time(self.decode_lengths.average(now))
        return self.history[instance].load(now, decode_ms, signal)

    def load_cost(
        self, instance: int, match: Match, prompt_len: int, now: float, decode_len: float | None = None
    ) -> float:
        """L + M + P of sending this request to ``instance`` (milliseconds). With the
        ``batch`` load model, L is what the instance's batch costs the request and the
        request costs the batch (``load_cost.batch_load``), and P is paid by the request and
        by every request decoding beside it while its prefill runs (requests still waiting
        for their own prefill go first and do not wait for it); with ``serial`` (the
        paper's), L is a DECODETIME per request and P the request's own prefill. Prompt
        tokens the instance's host tier holds cost their load-back, not a prefill.
        ``decode_len``: the request's own decoding length where it is known (a prefill
        that leaves after one token, ``disagg.py``), else the window's average; the
        requests decoding beside it decode the window's average either way."""
        cost = self.costs[instance]
        hosted = match.hosted_on(instance) if match.hosted else 0  # loaded back, not recomputed
        missed = prompt_len - match.cached_on(instance) - hosted
        prefill = self.prefill_time(instance, missed) + (cost.load_time(hosted) if hosted else 0.0)
        need = self.tree.held_tokens[instance] + missed + hosted - self.capacity[instance]
        evicted, per_user = 0.0, self.load_model == "serial"  # M on L's scale
        if need > 0:
            host = self.tree.host.pages[instance] if self.tiered[instance] else None
            evicted = memory_cost(self.tree, instance, need, match, now, cost, host, per_user)
        if self.load_model == "serial":
            return self.load(instance, now, self.load_signal) + prefill + evicted
        average = self.decode_lengths.average(now)
        d = average if decode_len is None else decode_len
        decoding = self.history[instance].decoding(cost.decode_time(average))  # the batch's, not d
        return self._batch_load(instance, match, prompt_len, now, d) + prefill * (1 + decoding) + evicted

    def prefill_time(self, instance: int, tokens: int) -> float:
        """PREFILLTIME of ``tokens`` on ``instance``, by its cost model (``disagg.E2PD``
        prices a prefill-only instance's passes)."""
        return self.costs[instance].prefill_time(tokens)

    def _batch_load(self, instance: int, match: Match, prompt_len: int, now: float, d: float) -> float:
        """``load_cost.batch_load`` of the instance at decoding length ``d``. Where its
        engine has a host tier, with the engine's picture of the batch: the KV its requests
        pin (their pages, a shared prefix once, from the tree's pending marks), the request
        adding only what they do not hold, and the prefill still queued
        (``InstanceHistory.queued_prefill``). On an engine without one, the batch's prompts
        summed and every prefill in flight queued: measured, the engine's picture there cost
        up to 2.8% on the average and 23% on p99 (docs/SCHEDULER.md, "The batch load model")."""
        h = self.history[instance]
        if self.tiered[instance]:
            queued, batch_kv = h.queued_prefill(now), self.tree.pinned_tokens[instance]
            new_kv = prompt_len - match.pinned_on(instance)
        else:
            queued, batch_kv, new_kv = h.in_flight_prefill_ms, h.in_flight_tokens, prompt_len
        return batch_load(
            h, self.costs[instance], d, prompt_len, self.capacity[instance], queued, batch_kv, new_kv
        )

    # ---- recording a decision ---------------------------------------------------------------

    def record(self, request: RoutingRequest, instance: int) -> None:
        self._record(request, instance, self.tree.match(request.chain(self.page_size)), self.clock())

    def _record(self, request: RoutingRequest, instance: int, match: Match, now: float) -> None:
        """Count the request in the instance's load and route it in the tree."""
        self._count(request, instance, match, now)
        self._route(request, instance, match, now)

    def _count(
        self, request: RoutingRequest, instance: int, match: Match, now: float, received: bool = False
    ) -> None:
        """Count the request in the instance's load; ``received``: its prompt's KV arrives
        from a prefill instance, so it prefills nothing here."""
        prompt_len = len(request.input_ids)
        hosted = match.hosted_on(instance) if match.hosted and not received else 0
        cached = prompt_len if received else match.cached_on(instance) + hosted
        work = (prompt_len - cached, hosted)
        decodes = request.params.max_tokens != 1  # (a prefill leg leaves after its first token)
        self.history[instance].add(request.request_id, now, self._price(instance, *work), cached / prompt_len,
                                   prompt_len, decodes, work)  # fmt: skip

    def _price(self, instance: int, prefilled: int, loaded: int) -> float:
        """A request's prefill time in its instance's load: PREFILLTIME and host load-backs."""
        cost = self.costs[instance]
        return self.prefill_time(instance, prefilled) + (cost.load_time(loaded) if loaded else 0.0)

    def reprice(self) -> None:
        """Instances whose fit moved (``Calibrated.calibrate``, on the probe thread): their
        load at the new price, here on the requests' thread that owns the history."""
        while self.repricing:
            instance = self.repricing.pop()
            self.priced_with[instance] = self.costs[instance]
            self.history[instance].reprice(functools.partial(self._price, instance))

    def _route(self, request: RoutingRequest, instance: int, match: Match, now: float) -> None:
        """Route the request in the tree: its prompt is held (pending) on ``instance``."""
        # Routing splits a node the prompt ends or branches off inside (only the last
        # matched node can be matched in part), and a split keeps the old object for the
        # lower half: the key portion is then its new parent.
        key = match.key
        split_key = key is not None and key is match.nodes[-1] and match.lengths[-1] < len(key.hashes)
        end = self.tree.route(request.chain(self.page_size), instance, now)
        self._routed[request.request_id] = (end, key.parent if split_key else key)
        self._decisions += 1
        if self._decisions % self.prune_every == 0:
            self.tree.prune(now)

    def learn(self, instance: int, load: dict) -> None:
        """The KV capacity an engine reports replaces the configured one; a host tier it
        reports makes what its device evicts a load-back, not a recompute (M); a sliding
        window it reports makes a hit end where its window is held (``cached_on``). The router
        hands over every health probe's answer (a joining engine's first before it routes
        there), so a tiered engine is priced as one from its first requests, not from its
        first finished one. A failed request's empty report is no snapshot: it changes
        nothing."""
        if "kv_pages_total" not in load:
            return
        self.tiered[instance] = bool(load.get("kv_host_pages_total"))
        self.tree.windows.windows[instance] = int(load.get("sliding_window", 0))  # hits end where held
        pages, size = load["kv_pages_total"], load.get("page_size")
        if pages and size:
            self.capacity[instance] = int(pages) * int(size)
            if int(size) != self.page_size and not self._page_size_warned:
                self._page_size_warned = True
                log.error(
                    "instance %d reports KV pages of %s tokens but E2 hashes prompts per %d: "
                    "no prefix will match; set the router's page_size to the engines'",
                    instance, size, self.page_size,
                )  # fmt: skip

    # ---- feedback: engine reports, completions, autoscaling ---------------------------------

    def _grow(self) -> None:
        self.tree.add_instance()
        self.history.append(InstanceHistory(self.tree.window_s))
        self.capacity.append(self.default_capacity)
        self.tiered.append(False)
        self._grow_costs()

    def _answers(self, request: RoutingRequest) -> bool:
        """Whether the request's output is an answer, whose length the window's average
        decoding length counts (``disagg.E2PD``: a prefill leg's one token is not)."""
        return True

    def on_finish(self, instance: int, request: RoutingRequest, info: FinishInfo) -> None:
        now = self.clock()
        self.learn(instance, info.load)
        self.tree.apply_events(instance, info.events)
        routed = self._routed.pop(request.request_id, None)
        if routed is None:
            return
        end, key = routed
        self.tree.finish(end, instance)
        self.history[instance].finish(request.request_id)
        if self._answers(request):
            self.decode_lengths.add(now, info.num_output_tokens)
        if key is not None and info.ttft_s is not None:
            self._autoscale(self.tree.live(key), info.ttft_s, now)


def _busy(loads: list[InstanceLoad], instance: int) -> float:
    """The live GPU utilization NVML reported for the instance (0 without NVML)."""
    return float(loads[instance].reported.get("gpu_utilization", 0.0)) if loads else 0.0
