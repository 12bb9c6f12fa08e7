"""E2: Exploitation + Exploration (paper §4.2, Algorithms 1 and 2), with post-assignment
rebalancing and prefix autoscaling.

Per request:
1. Match the prompt in the global prefix tree.
2. **Exploit** when more prompt tokens are cached somewhere than missing: among the
   instances holding the key portion (and its autoscaled replicas), the lowest L + M + P.
   **Rebalance**: if that choice is the most loaded instance and its load exceeds
   ``Th_bal`` × the lightest instance's, the request goes to the lightest instead — but
   only while the heavy instance has requests in flight and the load gap is larger than
   the recompute the move costs (the prefill of its cached tokens): a short history
   makes the ratio noisy, and an idle holder of the prefix serves it best.
3. **Explore** otherwise: an instance whose in-flight work is decode-heavy (mean cached
   fraction above ``decode_ratio_threshold``) takes the prefill-heavy request; else the
   lowest L + M + P over all instances.
4. **Autoscale**: when the time to first token of a key portion's requests doubles over
   the window, the least loaded instance that lacks it becomes a replica; its exploiting
   requests then split over the holders and replicas by load cost.
"""

from __future__ import annotations

import logging

from scheduler.cost_model import CostModel
from scheduler.global_tree import GlobalNode, GlobalPrefixTree, Match
from scheduler.load_cost import InstanceHistory, Routed, memory_cost
from scheduler.policy import Decision, FinishInfo, InstanceLoad, Policy, RoutingRequest

log = logging.getLogger("preble.e2")


class E2(Policy):
    name = "e2"

    def __init__(
        self,
        num_instances: int,
        cost_model: CostModel | str = "tiny_cpu",
        capacity_tokens: int | list[int] = 32768,
        window_s: float = 180.0,
        th_bal: float = 3.0,
        decode_ratio_threshold: float = 0.9,
        min_decode_units: int = 2,
        default_decode_len: float = 32.0,
        autoscale_min_samples: int = 4,
        prune_every: int = 200,
        load_signal: str = "in_flight",
        rebalance_signal: str = "history",
        **options,
    ) -> None:
        super().__init__(num_instances, **options)
        self.cost = cost_model if isinstance(cost_model, CostModel) else CostModel.load(cost_model)
        caps = capacity_tokens if isinstance(capacity_tokens, list) else [capacity_tokens] * num_instances
        self.capacity = list(caps)
        self.tree = GlobalPrefixTree(num_instances, window_s)
        self.history = [InstanceHistory(window_s, default_decode_len) for _ in range(num_instances)]
        self.th_bal = th_bal
        self.decode_ratio_threshold = decode_ratio_threshold
        self.min_decode_units = min_decode_units
        self.autoscale_min_samples = autoscale_min_samples
        self.prune_every = prune_every
        for key, value in (("load_signal", load_signal), ("rebalance_signal", rebalance_signal)):
            if value not in ("history", "in_flight"):
                raise ValueError(f"{key}={value!r} is invalid: expected history or in_flight")
        self.load_signal = load_signal
        self.rebalance_signal = rebalance_signal
        self._routed: dict[str, tuple[GlobalNode, GlobalNode | None]] = {}  # id -> (end, key portion)
        self._loads: list[InstanceLoad] = []  # the router's view during the current select
        self._next = 0  # where round-robin tie-breaking starts
        self._decisions = 0

    # ---- Algorithm 2 ----------------------------------------------------------------------

    def _load_and_prefill(
        self, instance: int, match: Match, prompt_len: int, now: float
    ) -> tuple[float, int]:
        missed = prompt_len - match.cached_on(instance)
        load = self.history[instance].load(self.cost, now, self.load_signal)
        return load + self.cost.prefill_time(missed), missed

    def load_cost(self, instance: int, match: Match, prompt_len: int, now: float) -> float:
        """L + M + P of sending this request to ``instance`` (milliseconds)."""
        partial, missed = self._load_and_prefill(instance, match, prompt_len, now)
        return partial + memory_cost(
            self.tree, instance, match, missed, self.capacity[instance], self.cost, now
        )

    def _busy(self, instance: int) -> float:
        """The live GPU utilization NVML reported for the instance (0 without NVML)."""
        return float(self._loads[instance].reported.get("gpu_utilization", 0.0)) if self._loads else 0.0

    def _cheapest(self, candidates, match: Match, prompt_len: int, now: float) -> int:
        """Lowest L + M + P; equal costs go to the less busy GPU (NVML), then round-robin,
        so an idle cluster spreads work (and cache) instead of piling it on instance 0.
        M (a virtual eviction walk) is the costly term and never negative, so instances are
        costed in order of L + P and the search stops once L + P alone cannot beat the best
        total (same answer, less work)."""
        if len(candidates) == 1:
            return next(iter(candidates))  # nothing to compare
        bounds = sorted((*self._load_and_prefill(i, match, prompt_len, now), i) for i in candidates)
        best, best_key = None, (float("inf"),)
        for partial, missed, i in bounds:
            if partial > best_key[0]:
                break
            total = partial + memory_cost(self.tree, i, match, missed, self.capacity[i], self.cost, now)
            key = (total, self._busy(i), (i - self._next) % self.num_instances)
            if key < best_key:
                best, best_key = i, key
        self._next = (best + 1) % self.num_instances
        return best

    # ---- Algorithm 1 ----------------------------------------------------------------------

    def select(self, request: RoutingRequest, loads: list[InstanceLoad]) -> Decision:
        now = self.clock()
        self._loads = loads
        self._refresh_capacity(loads)
        tokens = request.input_ids
        match = self.tree.match(tokens)
        cached = match.matched
        key = match.key_portion()
        if cached > len(tokens) - cached and key is not None:
            candidates = key.holders() | self._replicas(match)
            choice = self._cheapest(candidates, match, len(tokens), now)
            decision = self._rebalance(choice, match, now) or Decision(choice, "exploit")
        else:
            decision = self._decode_balance() or Decision(
                self._cheapest(range(self.num_instances), match, len(tokens), now), "explore"
            )
        self._record(request, decision.instance, match, key, now)
        return decision

    def _rebalance(self, choice: int, match: Match, now: float) -> Decision | None:
        if self.th_bal == float("inf"):
            return None  # rebalancing off
        loads = [h.load(self.cost, now, self.rebalance_signal) for h in self.history]
        heavy = max(range(self.num_instances), key=lambda i: loads[i])
        light = min(range(self.num_instances), key=lambda i: (loads[i], self._busy(i), i))
        if choice != heavy or heavy == light or loads[heavy] <= self.th_bal * loads[light]:
            return None
        if not self.history[choice].in_flight:
            return None  # nothing queues there now: reusing its cache costs nothing extra
        if loads[heavy] - loads[light] <= self.cost.prefill_time(match.cached_on(choice)):
            return None  # moving costs more recompute than the imbalance it fixes
        return Decision(light, "rebalance")

    def _decode_balance(self) -> Decision | None:
        ratios = [
            h.decode_ratio() if len(h.in_flight) >= self.min_decode_units else 0.0 for h in self.history
        ]
        best = max(range(self.num_instances), key=lambda i: ratios[i])
        if ratios[best] > self.decode_ratio_threshold:
            return Decision(best, "explore_decode_balance")
        return None

    def _record(self, request: RoutingRequest, instance: int, match: Match, key, now: float) -> None:
        prompt_len = len(request.input_ids)
        cached = match.cached_on(instance)
        missed = prompt_len - cached
        self.history[instance].add(
            request.request_id, Routed(now, self.cost.prefill_time(missed), cached / prompt_len)
        )
        end = self.tree.route(request.input_ids, instance, now)
        self._routed[request.request_id] = (end, self._node_ending_at(end, match, key))
        self._decisions += 1
        if self._decisions % self.prune_every == 0:
            self.tree.prune(now)

    @staticmethod
    def _node_ending_at(end: GlobalNode, match: Match, key: GlobalNode | None) -> GlobalNode | None:
        """The key portion's node on the routed path (routing may have split the node the
        match saw, and a split keeps the old object for the lower half)."""
        if key is None:
            return None
        depth = 0
        for node, n in zip(match.nodes, match.lengths):
            depth += n
            if node is key:
                break
        pos = 0
        for node in end.path():
            pos += len(node.key)
            if pos == depth:
                return node
        return None

    def _refresh_capacity(self, loads: list[InstanceLoad]) -> None:
        for i, load in enumerate(loads):
            pages, size = load.reported.get("kv_pages_total"), load.reported.get("page_size")
            if pages and size:
                self.capacity[i] = int(pages) * int(size)

    # ---- feedback: engine reports, completions, autoscaling ---------------------------------

    def on_finish(self, instance: int, request: RoutingRequest, info: FinishInfo) -> None:
        now = self.clock()
        self.tree.apply_events(instance, info.events)
        routed = self._routed.pop(request.request_id, None)
        if routed is None:
            return
        end, key = routed
        self.tree.finish(end, instance)
        self.history[instance].finish(request.request_id, now, info.num_output_tokens)
        if key is not None and info.ttft_s is not None:
            self._autoscale(key, info.ttft_s, now)

    def _autoscale(self, key: GlobalNode, ttft: float, now: float) -> None:
        samples = key.ttft
        samples.append((now, ttft))
        horizon = now - self.tree.window_s
        while samples and samples[0][0] < horizon:
            samples.popleft()
        half = now - self.tree.window_s / 2
        older = [t for ts, t in samples if ts < half]
        recent = [t for ts, t in samples if ts >= half]
        if len(older) < self.autoscale_min_samples or len(recent) < self.autoscale_min_samples:
            return
        if sum(recent) / len(recent) < 2 * sum(older) / len(older):
            return
        lacking = [i for i in range(self.num_instances) if not key.held_by(i) and i not in key.replicas]
        if lacking:
            replica = min(lacking, key=lambda i: self.history[i].load(self.cost, now, self.load_signal))
            key.replicas.add(replica)
            samples.clear()  # measure afresh with the replica serving
            log.info("autoscale: key portion of %d tokens replicated on instance %d", len(key.key), replica)

    def _replicas(self, match: Match) -> set[int]:
        out: set[int] = set()
        for node in match.nodes:
            out |= node.replicas
        return out
