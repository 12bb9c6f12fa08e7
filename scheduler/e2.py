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
import math
from collections import deque

from scheduler.cost_model import CostModel
from scheduler.global_tree import GlobalPrefixTree
from scheduler.load_cost import InstanceHistory, VirtualEviction
from scheduler.policy import Decision, FinishInfo, InstanceLoad, Policy, RoutingRequest
from scheduler.tree_node import GlobalNode, Match

log = logging.getLogger("preble.e2")


class TTFTHistory:
    """A key portion's times to first token within the window, split at its midpoint into
    two FIFOs with running sums, so each completion costs O(1)."""

    def __init__(self) -> None:
        self.older: deque[tuple[float, float]] = deque()
        self.recent: deque[tuple[float, float]] = deque()
        self.older_sum = self.recent_sum = 0.0

    def add(self, now: float, ttft: float, window_s: float) -> None:
        self.recent.append((now, ttft))
        self.recent_sum += ttft
        half, horizon = now - window_s / 2, now - window_s
        while self.recent and self.recent[0][0] < half:
            sample = self.recent.popleft()
            self.recent_sum -= sample[1]
            self.older.append(sample)
            self.older_sum += sample[1]
        while self.older and self.older[0][0] < horizon:
            self.older_sum -= self.older.popleft()[1]

    def doubled(self, min_samples: int) -> bool:
        """Whether the recent half's mean is at least twice the older half's."""
        if len(self.older) < min_samples or len(self.recent) < min_samples:
            return False
        return self.recent_sum / len(self.recent) >= 2 * self.older_sum / len(self.older)


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
        page_size: int = 16,
        load_signal: str = "in_flight",
        rebalance_signal: str = "history",
        **options,
    ) -> None:
        super().__init__(num_instances, **options)
        self.cost = cost_model if isinstance(cost_model, CostModel) else CostModel.load(cost_model)
        caps = capacity_tokens if isinstance(capacity_tokens, list) else [capacity_tokens] * num_instances
        self.capacity = list(caps)
        self.page_size = page_size  # the engines' KV page size: prompts are hashed per page
        self.tree = GlobalPrefixTree(num_instances, window_s, page_size)
        self.evictions = [VirtualEviction(self.tree, i, self.cost) for i in range(num_instances)]
        self.history = [
            InstanceHistory(window_s, default_decode_len, self.cost) for _ in range(num_instances)
        ]
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
        # Decisions are immutable: the usual ones are made once, not per request.
        self._exploit = [Decision(i, "exploit") for i in range(num_instances)]
        self._explore = [Decision(i, "explore") for i in range(num_instances)]
        self._decisions = 0
        self._page_size_warned = False

    # ---- Algorithm 2 ----------------------------------------------------------------------

    def _load_and_prefill(
        self, instance: int, match: Match, prompt_len: int, now: float
    ) -> tuple[float, int]:
        missed = prompt_len - match.cached_on(instance) if match.nodes else prompt_len
        load = self.history[instance].load(now, self.load_signal)
        return load + self.cost.prefill_time(missed), missed

    def load_cost(self, instance: int, match: Match, prompt_len: int, now: float) -> float:
        """L + M + P of sending this request to ``instance`` (milliseconds)."""
        partial, missed = self._load_and_prefill(instance, match, prompt_len, now)
        return partial + self._memory_cost(instance, match, missed, now)

    def _memory_cost(self, instance: int, match: Match, missed: int, now: float) -> float:
        need = self.tree.held_tokens[instance] + missed - self.capacity[instance]
        return self.evictions[instance](need, match, now) if need > 0 else 0.0  # fits: nothing evicted

    def _busy(self, instance: int) -> float:
        """The live GPU utilization NVML reported for the instance (0 without NVML)."""
        return float(self._loads[instance].reported.get("gpu_utilization", 0.0)) if self._loads else 0.0

    def _tie_break(self, instance: int) -> tuple[float, int]:
        return self._busy(instance), (instance - self._next) % self.num_instances

    def _cheapest(self, candidates, match: Match, prompt_len: int, now: float) -> int:
        """Lowest L + M + P; equal costs go to the less busy GPU (NVML), then round-robin,
        so an idle cluster spreads work (and cache) instead of piling it on instance 0.
        M (a virtual eviction walk) is the costly term and never negative, so instances are
        costed in order of L + P and the search stops once L + P alone cannot beat the best
        total (same answer, less work)."""
        if len(candidates) == 1:
            return next(iter(candidates))  # nothing to compare
        bounds = sorted((*self._load_and_prefill(i, match, prompt_len, now), i) for i in candidates)
        best, best_total = None, math.inf
        for partial, missed, i in bounds:
            if partial > best_total:
                break
            total = partial + self._memory_cost(i, match, missed, now)
            if total < best_total or (total == best_total and self._tie_break(i) < self._tie_break(best)):
                best, best_total = i, total
        self._next = (best + 1) % self.num_instances
        return best

    # ---- Algorithm 1 ----------------------------------------------------------------------

    def select(self, request: RoutingRequest, loads: list[InstanceLoad]) -> Decision:
        now = self.clock()
        self._loads = loads
        prompt_len = len(request.input_ids)
        chain = request.chain(self.page_size)
        match = self.tree.match(chain)
        cached = match.matched
        key = match.key
        candidates = set()
        if cached > prompt_len - cached and key is not None:
            candidates = key.holders()
            for node in match.nodes:  # autoscaled replicas of the path serve it too
                if node.replicas:
                    candidates |= node.replicas
            candidates &= self.live
        if candidates:
            choice = self._cheapest(candidates, match, prompt_len, now)
            # Nothing queues on an instance with nothing in flight: reusing its cache there
            # costs nothing extra, so only a busy choice is worth a rebalancing look.
            rebalanced = self.history[choice].in_flight and self._rebalance(choice, match, now)
            decision = rebalanced or self._exploit[choice]
        else:
            decision = (
                self._decode_balance()
                or self._explore[self._cheapest(self.live, match, prompt_len, now)]
            )
        self._record(request, chain, decision.instance, match, key, now)
        return decision

    def _rebalance(self, choice: int, match: Match, now: float) -> Decision | None:
        """For a choice with requests in flight. Cheapest tests first: most exploit
        decisions fail one of the O(1) ones."""
        if self.th_bal == math.inf:
            return None  # rebalancing off
        signal, history = self.rebalance_signal, self.history
        mine = history[choice].load(now, signal)
        recompute = self.cost.prefill_time(match.cached_on(choice))
        if mine <= recompute:
            return None  # no gap to the lightest can exceed the recompute the move costs
        loads = {i: history[i].load(now, signal) for i in self.live}
        for i, load in loads.items():  # is the choice the heaviest (first of equals)?
            if load > mine or (load == mine and i < choice):
                return None
        light = min(loads, key=lambda i: (loads[i], self._busy(i), i))
        if light == choice or mine <= self.th_bal * loads[light] or mine - loads[light] <= recompute:
            return None
        return Decision(light, "rebalance")

    def _decode_balance(self) -> Decision | None:
        ratios = {}
        for i in sorted(self.live):
            h = self.history[i]
            ratios[i] = h.decode_ratio() if len(h.in_flight) >= self.min_decode_units else 0.0
        best = max(ratios, key=lambda i: ratios[i])
        if ratios[best] > self.decode_ratio_threshold:
            return Decision(best, "explore_decode_balance")
        return None

    def _record(
        self, request: RoutingRequest, chain, instance: int, match: Match, key: GlobalNode | None, now: float
    ) -> None:
        prompt_len = len(request.input_ids)
        cached = match.cached_on(instance)
        missed = prompt_len - cached
        self.history[instance].add(
            request.request_id, now, self.cost.prefill_time(missed), cached / prompt_len
        )
        # Routing splits a node the prompt ends or branches off inside (only the last
        # matched node can be matched in part), and a split keeps the old object for the
        # lower half: the key portion is then its new parent.
        split_key = key is not None and key is match.nodes[-1] and match.lengths[-1] < len(key.hashes)
        end = self.tree.route(chain, instance, now, match)
        self._routed[request.request_id] = (end, key.parent if split_key else key)
        self._decisions += 1
        if self._decisions % self.prune_every == 0:
            self.tree.prune(now)

    def _learn_capacity(self, instance: int, report: dict) -> None:
        """The KV capacity an engine reports replaces the configured one."""
        pages, size = report.get("kv_pages_total"), report.get("page_size")
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

    def forget(self, instance: int) -> None:
        self.tree.forget(instance)

    def on_finish(self, instance: int, request: RoutingRequest, info: FinishInfo) -> None:
        now = self.clock()
        self._learn_capacity(instance, info.load)
        self.tree.apply_events(instance, info.events)
        routed = self._routed.pop(request.request_id, None)
        if routed is None:
            return
        end, key = routed
        self.tree.finish(end, instance)
        self.history[instance].finish(request.request_id, now, info.num_output_tokens)
        if key is not None and info.ttft_s is not None:
            self._autoscale(self.tree.live(key), info.ttft_s, now)

    def _autoscale(self, key: GlobalNode, ttft: float, now: float) -> None:
        if key.ttft is None:
            key.ttft = TTFTHistory()
        history: TTFTHistory = key.ttft
        history.add(now, ttft, self.tree.window_s)
        if not history.doubled(self.autoscale_min_samples):
            return
        lacking = [i for i in sorted(self.live) if not key.held_by(i) and i not in key.replicas]
        if lacking:
            replica = min(lacking, key=lambda i: self.history[i].load(now, self.load_signal))
            key.replicas = key.replicas | {replica}
            key.ttft = None  # measure afresh with the replica serving
            log.info(
                "autoscale: key portion of %d tokens replicated on instance %d",
                len(key.hashes) * self.page_size,
                replica,
            )
