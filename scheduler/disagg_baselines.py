"""The anchors' prefill/decode rules, behind the same interface as ``E2PD``.

- ``dynamo_pd``: NVIDIA Dynamo. Its KV router (``kv_cost``: overlap and active blocks)
  picks the decode worker; *conditional disaggregation* then keeps the prefill local when
  the uncached part is short: fewer than ``max_local_prefill`` (2,048) tokens uncached that
  are also under ``max_uncached_share`` (70%) of the prompt. Otherwise the KV router picks a
  prefill worker. ``prefill_queue`` set (the prefill-load variant): also local while every
  prefill worker has that many requests in flight.
- ``llmd_pd``: llm-d. The decode pod first, by prefix score and load (a KV-event tree's
  match share plus one minus the pod's share of the most in-flight requests, weights 1 and
  1: ours), then P/D only when the tokens not cached on that pod exceed ``threshold`` (its
  ``pd-profile-handler``; we take 512), with the prefill pod scored the same way.
- ``sglang_pd``: SGLang's model gateway. Always disaggregated; the prefill and the decode
  worker picked independently, each by ``cache_aware`` among its own kind.

Given ``roles`` (the simulator) every instance may be paired. Live (``policy: dynamo_pd``
and so on, for measuring against E2 on a real stack), each rule learns the roles from the
engines' reports as ``E2PD`` does, and pairs only engines that move KV (they report
``kv_bytes_per_token``) of one KV shape; with none, each is its aggregated router.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from preble_backend.common.settings import DEFAULT_PAGE_SIZE
from scheduler.baselines import CacheAware, KVCost
from scheduler.disagg import EngineRoles, prefill_leg
from scheduler.global_tree import GlobalPrefixTree
from scheduler.policy import Decision, FinishInfo, InstanceLoad, MirrorsCaches, Policy, RoutingRequest


class _Roles(EngineRoles, Policy):
    """Roles and the engines that move KV (``EngineRoles``), and the anchor's own router
    (``self.router``, where it has one), which hears of every engine as the rule does."""

    router: Policy | None = None

    def __init__(self, num_instances: int, roles, clock: Callable[[], float]) -> None:
        super().__init__(num_instances, clock)
        self._init_roles(num_instances, roles)

    def learn(self, instance: int, load: dict) -> None:
        self._learn_role(instance, load)
        if self.router is not None:
            self.router.learn(instance, load)

    def _prefillers(self, decode: int) -> set[int]:
        """The instances that may prefill for ``decode``: none unless both move KV."""
        return (self._with("prefill") & self.movable) - {decode} if decode in self.movable else set()

    def _grow(self) -> None:
        self.roles.append("both")
        if self.router is not None:
            self.router.add_instance()

    def forget(self, instance: int) -> None:
        if self.router is not None:
            self.router.forget(instance)

    def resync(self, instance: int) -> None:
        if self.router is not None:
            self.router.resync(instance)

    def record(self, request: RoutingRequest, instance: int) -> None:
        if self.router is not None:
            self.router.record(request, instance)

    def cached_tokens(self, instance: int) -> int | None:
        return self.router.cached_tokens(instance) if self.router is not None else None

    def on_finish(self, instance: int, request: RoutingRequest, info: FinishInfo) -> None:
        if self.router is not None:
            self.router.on_finish(instance, request, info)


def _among(policy: Policy, instances: set[int], request: RoutingRequest, loads) -> int:
    """``policy``'s choice (recorded in its state) among ``instances`` only."""
    with policy.only(instances):
        return policy.select(request, loads).instance


class DynamoPD(_Roles):
    name = "dynamo_pd"

    def __init__(self, num_instances: int, roles=(), max_local_prefill: int = 2048,
                 max_uncached_share: float = 0.7, prefill_queue: int | None = None,
                 page_size: int = DEFAULT_PAGE_SIZE,
                 clock: Callable[[], float] = time.monotonic) -> None:  # fmt: skip
        super().__init__(num_instances, roles, clock)
        self.router = KVCost(num_instances, page_size=page_size, clock=clock)
        self.max_local_prefill = max_local_prefill
        self.max_uncached_share = max_uncached_share
        self.prefill_queue = prefill_queue

    def select(self, request: RoutingRequest, loads: list[InstanceLoad]) -> Decision:
        decode = _among(self.router, self._decoders(), request, loads)
        prompt = len(request.input_ids)
        uncached = prompt - self.router.tree.match(request.chain(self.router.block_size)).cached_on(decode)
        prefillers = self._prefillers(decode)
        short = uncached < self.max_local_prefill and uncached < self.max_uncached_share * prompt
        queue = self.prefill_queue
        busy = queue is not None and bool(prefillers) and all(loads[i].in_flight >= queue for i in prefillers)
        if short or busy or not prefillers:
            return Decision(decode, "local_busy" if busy and not short else "local")
        prefill = _among(self.router, prefillers, prefill_leg(request), loads)
        return Decision(decode, "remote", prefill=prefill)


class LlmdPD(MirrorsCaches, _Roles):
    name = "llmd_pd"

    def __init__(self, num_instances: int, roles=(), threshold: int = 512, page_size: int = DEFAULT_PAGE_SIZE,
                 clock: Callable[[], float] = time.monotonic) -> None:  # fmt: skip
        super().__init__(num_instances, roles, clock)
        self.threshold = threshold
        self.page_size = page_size
        self.tree = GlobalPrefixTree(num_instances, page_size=page_size)  # fed by KV events only

    def _pick(self, instances: set[int], match, prompt: int, loads) -> int:
        most = max(1, max(loads[i].in_flight for i in instances))

        def score(i: int) -> tuple:
            return match.cached_on(i) / prompt + 1 - loads[i].in_flight / most, -i

        return max(instances, key=score)

    def select(self, request: RoutingRequest, loads: list[InstanceLoad]) -> Decision:
        match = self.tree.match(request.chain(self.page_size))
        prompt = len(request.input_ids)
        decode = self._pick(self._decoders(), match, prompt, loads)
        prefillers = self._prefillers(decode)
        if prompt - match.cached_on(decode) <= self.threshold or not prefillers:
            return Decision(decode, "local")
        return Decision(decode, "remote", prefill=self._pick(prefillers, match, prompt, loads))

    def _grow(self) -> None:
        super()._grow()
        self.tree.add_instance()

    def on_finish(self, instance: int, request: RoutingRequest, info: FinishInfo) -> None:
        self.tree.apply_events(instance, info.events)


class SGLangPD(_Roles):
    name = "sglang_pd"

    def __init__(self, num_instances: int, roles=(), page_size: int = DEFAULT_PAGE_SIZE,
                 clock: Callable[[], float] = time.monotonic) -> None:  # fmt: skip
        super().__init__(num_instances, roles, clock)
        self.router = CacheAware(num_instances, page_size=page_size, clock=clock)

    def select(self, request: RoutingRequest, loads: list[InstanceLoad]) -> Decision:
        decode = _among(self.router, self._decoders(), request, loads)
        prefillers = self._prefillers(decode)
        if not prefillers:
            return Decision(decode, "local")
        return Decision(decode, "pd", prefill=_among(self.router, prefillers, prefill_leg(request), loads))
