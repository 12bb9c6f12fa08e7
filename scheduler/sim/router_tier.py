"""Routers that hold requests, for the anchors' router-local fairness (issue 65).

llm-d's flow control and Dynamo's per-class queues decide which tenant goes next in the
router: each router holds what it cannot dispatch yet and orders it with state of its
own. Here each of ``num_routers`` routers dispatches at most ``max_inflight`` requests at
a time and picks the next by its rule (``RULES``); the engines behind them run the paper's
queue. A request names its router (``SimRequest.router``), so a client skewed towards one
router is one scenario among others.

- ``fcfs``: arrival order;
- ``rr``: llm-d's per-tenant turns, one request each;
- ``drr``: Dynamo's deficit round-robin over prompt tokens;
- ``vtc``: the least served tenant per unit of weight, as this router alone counted it
  (prompt tokens computed, output ×2; cache hits free), lifted on return;
- ``vtc_basic``: AIBrix's basic VTC: every input token charged, cached or not.

The same queue classes as the engines' (``FairWaitQueue`` and ``fair_baselines.py``), each
request in one group, so within a tenant it is first come, first served.
"""

from __future__ import annotations

from preble_backend.common.fair_share import ServiceWeights, TenantShares
from preble_backend.common.sampling_params import SamplingParams
from preble_backend.engine.outputs.sampling import SamplerState
from preble_backend.engine.scheduling.fair_queue import FairWaitQueue
from preble_backend.engine.scheduling.priority_queue import PriorityWaitQueue
from preble_backend.engine.scheduling.request import Request
from scheduler.sim.fair_baselines import DeficitQueue, RoundRobinQueue

RULES = ("fcfs", "rr", "drr", "vtc", "vtc_basic")


class SimRouter:
    """One router: its queue, its count of what it dispatched, its counter of service."""

    def __init__(self, rule: str, max_inflight: int, weights: dict[str, float] | None = None) -> None:
        if rule not in RULES:
            raise ValueError(f"router rule {rule!r} is unknown: expected one of {', '.join(RULES)}")
        charged = ServiceWeights(cached_weight=1.0 if rule == "vtc_basic" else 0.0)
        self.shares = TenantShares(weights=dict(weights or {}), service_weights=charged)
        queues = {"fcfs": None, "rr": RoundRobinQueue, "drr": DeficitQueue}
        kind = queues.get(rule, FairWaitQueue)
        self.queue = PriorityWaitQueue(1) if kind is None else kind(self.shares, num_groups=1)
        self.max_inflight = max_inflight
        self.inflight = 0
        self.held: dict[int, tuple] = {}  # id of its queue entry -> (request, when it arrived)

    def arrive(self, req, now: float) -> list[tuple]:
        """Queue ``req``; what may be dispatched now, as (request, when it arrived)."""
        params = SamplingParams(max_tokens=req.output_len)
        entry = Request(req.request_id, list(req.input_ids), params, SamplerState(params), tenant=req.tenant)
        self.queue.push(entry, 0)
        self.held[id(entry)] = (req, now)
        return self._dispatch()

    def finished(self, tenant: str, computed: int, cached: int, output: int) -> list[tuple]:
        """One of its requests ended: it is charged, and its slot goes to the next."""
        self.inflight -= 1
        self.shares.charge(tenant, "router", computed=computed, cached=cached, output=output)
        return self._dispatch()

    def _dispatch(self) -> list[tuple]:
        out = []
        while self.inflight < self.max_inflight and len(self.queue):
            entry = next(self.queue.candidates())
            self.queue.take(entry)
            self.inflight += 1
            out.append(self.held.pop(id(entry)))
        return out


class RouterTier:
    """``num_routers`` routers of one rule; each request names its own."""

    def __init__(self, num_routers: int, rule: str, max_inflight: int,
                 weights: dict[str, float] | None = None) -> None:  # fmt: skip
        self.routers = [SimRouter(rule, max_inflight, weights) for _ in range(num_routers)]
        self.held_by: dict[str, tuple[SimRouter, str]] = {}  # request id -> its router, its tenant

    def arrive(self, req, now: float) -> list[tuple]:
        router = self.routers[req.router]
        self.held_by[req.request_id] = (router, req.tenant)
        return router.arrive(req, now)

    def finished(self, request_id: str, record) -> list[tuple]:
        """A request ended (``record``: its prompt, what the cache served, its output)."""
        router, tenant = self.held_by.pop(request_id)
        computed = record.prompt_len - record.cached_tokens
        return router.finished(tenant, computed, record.cached_tokens, record.output_len)
