"""Discrete-event simulator of a Preble cluster.

Each simulated instance runs the engine's real local scheduler, block manager, radix
cache and priority wait queue (over a KV pool of one number per token), so chunked
prefill, prefix sharing, LRU eviction and preemption behave exactly as in the engine;
only the model forward is replaced by the cost model's iteration time. The global policy
sees the same interface as in the router: requests at arrival, and on completion the
instance's cache events and load snapshot. Outputs are pseudo-random token ids, so
parallel samples of one prompt do not share outputs, unless the request names the tokens
it generates (a chat turn's answer, which the next turn's prompt replays). A request that
follows another (a conversation's next turn) arrives ``think_s`` after that one finishes.
"""

from __future__ import annotations

import heapq
import itertools
import zlib
from dataclasses import dataclass, field

import numpy as np
import torch

from preble_backend.common.cost_model import CostModel
from preble_backend.common.fair_share import DEFAULT_TENANT, TenantShares
from preble_backend.common.pass_costs import PassCosts
from preble_backend.common.sampling_params import SamplingParams
from preble_backend.engine.config import EngineConfig
from preble_backend.engine.outputs.sampling import SamplerState
from preble_backend.engine.scheduling.local_scheduler import ScheduledBatch, make_local_scheduler
from preble_backend.engine.scheduling.request import Request
from preble_backend.model.kv_pool import KVPool
from scheduler.disagg import KVLink
from scheduler.policy import FinishInfo, InstanceLoad, Policy, RoutingRequest
from scheduler.sim.disagg_legs import Legs
from scheduler.sim.router_tier import RouterTier

SIMULATED = "(simulated)"  # the model path of a simulated engine: the cost model stands in


@dataclass(frozen=True)
class SimConfig:
    """A simulated cluster: ``num_instances`` engines configured as real ones; each one's KV
    capacity is its ``max_num_tokens``."""

    num_instances: int = 4
    engine: EngineConfig = field(default_factory=lambda: EngineConfig(SIMULATED, max_num_tokens=240_000))

    @classmethod
    def of(cls, num_instances: int, capacity_tokens: int = 240_000, **engine_settings) -> SimConfig:
        """``engine_settings``: any other ``EngineConfig`` field (page_size, chunk_size,
        host_kv_tokens for a host tier below each instance's device KV, ...)."""
        return cls(num_instances, EngineConfig(SIMULATED, max_num_tokens=capacity_tokens, **engine_settings))

    @property
    def capacity_tokens(self) -> int:
        return self.engine.max_num_tokens

    @property
    def page_size(self) -> int:
        return self.engine.page_size


@dataclass
class SimRequest:
    request_id: str
    arrival: float
    input_ids: list[int]
    output_len: int
    chains: dict[int, list[int]] = field(default_factory=dict)  # page chain hashes, once per prompt
    output_ids: list[int] | None = None  # what it generates (else pseudo-random ids)
    after: str | None = None  # the request it follows: it arrives think_s after that one finishes
    think_s: float = 0.0
    tenant: str = DEFAULT_TENANT  # whose share it is served from (fair_share)
    router: int = 0  # which router it reaches (a router tier that holds requests: router_tier.py)


@dataclass
class RequestRecord:
    arrival: float
    instance: int = -1
    branch: str = ""
    prefill_instance: int = -1  # disaggregated: where it prefilled
    first_token: float | None = None
    finish: float | None = None
    prompt_len: int = 0
    cached_tokens: int = 0
    output_len: int = 0


class SimInstance:
    def __init__(self, index: int, cfg: SimConfig, cost: CostModel, reporting: bool = False,
                 shares: TenantShares | None = None, wait_queue=None) -> None:  # fmt: skip
        self.index = index
        self.cost = cost  # its true costs
        # its passes, as an engine reports them, kept only for a policy that learns from them
        self.passes = PassCosts(cost.num_experts, cost.experts_per_token) if reporting else None
        num_pages = cfg.capacity_tokens // cfg.page_size
        self.pool = _pool(num_pages, cfg.page_size)
        host_pages = cfg.engine.host_pages(num_pages)
        host = _pool(host_pages, cfg.page_size) if host_pages else None
        self.scheduler = make_local_scheduler(self.pool, cfg.engine, host, shares, source=f"e{index}")
        if wait_queue is not None:  # another rule for which tenant admits next
            self.scheduler.waiting = wait_queue(self.scheduler.shares)
        self.cache = self.scheduler.blocks.cache
        self.busy = False
        self.batch: ScheduledBatch | None = None
        self.outputs: dict[str, list[int]] = {}  # the named outputs of requests running here

    def add(self, req: SimRequest, received: bool = False) -> Request:
        params = SamplingParams(max_tokens=req.output_len, ignore_eos=True, temperature=0)
        engine_req = Request(req.request_id, list(req.input_ids), params, SamplerState(params),
                             tenant=req.tenant, received=received)  # fmt: skip
        if req.output_ids is not None:
            self.outputs[req.request_id] = req.output_ids
        self.scheduler.add(engine_req)
        return engine_req

    def start_iteration(self) -> float | None:
        """Form the next batch; return its duration in seconds (None when idle)."""
        batch = self.scheduler.schedule()
        if not batch:
            self.busy = False
            return None
        self.busy, self.batch = True, batch
        work = batch.work()
        ms = self.cost.iteration_time(*work)
        if self.passes is not None:
            self.passes.add(work, ms)
        return ms / 1000.0

    def finish_iteration(self) -> tuple[list[Request], list[Request]]:
        """Apply the batch: requests that produced their first token, requests finished."""
        batch, self.batch = self.batch, None
        self.scheduler.advance(batch)
        first, done = [], []
        for req in batch.requests:
            if req.num_computed < req.num_tokens:
                continue
            if not req.output_ids:
                first.append(req)
            named, i = self.outputs.get(req.request_id), len(req.output_ids)
            req.output_ids.append(named[i] if named and i < len(named) else _output_token(req.request_id, i))
            if len(req.output_ids) >= req.params.max_tokens:
                self.outputs.pop(req.request_id, None)
                self.scheduler.finish(req)
                done.append(req)
        return first, done

    def stats(self) -> dict:
        return {
            "page_size": self.pool.page_size,
            "chunk_size": self.scheduler.chunk_size,
            "kv_pages_total": self.pool.num_pages,
            "kv_pages_used": self.pool.num_used,
            "waiting": len(self.scheduler.waiting),
            "running": len(self.scheduler.running),
            "kv_host_pages_total": self.cache.host.pool.num_pages if self.cache and self.cache.host else 0,
        }

    def cost_report(self) -> dict:
        """What a health probe's answer adds: what it serves and what its passes cost."""
        facts = {
            "model": self.cost.model,
            "device": self.cost.device,
            "tensor_parallel": self.cost.tensor_parallel,
        }
        return {"cost_facts": facts, "pass_costs": self.passes.report()}


def _pool(num_pages: int, page_size: int) -> KVPool:
    return KVPool(num_pages, page_size, num_layers=1, num_kv_heads=1, head_dim=1, dtype=torch.float16)


def _output_token(request_id: str, i: int) -> int:
    """Pseudo-random but stable across runs (``hash`` of a str is salted per process)."""
    return 1_000_000 + (zlib.crc32(f"{request_id}/{i}".encode()) & 0xFFFFF)


@dataclass
class SimResult:
    records: dict[str, RequestRecord] = field(default_factory=dict)
    instances: list[SimInstance] = field(default_factory=list)
    end_time: float = 0.0
    moved_tokens: int = 0  # KV moved from prefill to decode instances


def simulate(
    requests: list[SimRequest],
    policy_factory,
    cfg: SimConfig,
    cost: CostModel | list[CostModel],
    link: KVLink | None = None,
    shares: TenantShares | None = None,
    wait_queue=None,
    routers: RouterTier | None = None,
) -> SimResult:
    """Run ``requests`` (with arrival times) through a cluster routed by the policy that
    ``policy_factory(clock)`` builds; ``cost``: every instance's true costs, or each one's
    (a mixed cluster). The policy hears each instance's pass costs when a request finishes
    there (``Policy.calibrate``), as a router hears them from its probes. ``link``: what
    moving KV costs, for a policy that disaggregates (``disagg_legs.py``). ``shares``: with
    ``fair_share`` engines, the one counter every instance admits by (the cluster's, as if
    exchanged at once); None: each instance its own. ``wait_queue``: builds each
    instance's wait queue from its counter (the anchors' rules, ``fair_baselines.py``).
    ``routers``: routers that hold requests and order them by a rule of their own
    (``router_tier.py``); without them each request is routed as it arrives."""
    now = [0.0]
    policy: Policy = policy_factory(lambda: now[0])
    costs = cost if isinstance(cost, list) else [cost] * cfg.num_instances
    learns = policy.calibrating
    instances = [SimInstance(i, cfg, costs[i], learns, shares, wait_queue) for i in range(cfg.num_instances)]
    _refuse_oversized(requests, instances[0].pool.capacity_tokens)
    loads = [InstanceLoad() for _ in instances]
    for inst in instances:  # the router's first health probe of each engine, before it routes there
        policy.learn(inst.index, inst.stats())
        if learns:
            policy.calibrate(inst.index, inst.cost_report())
    result = SimResult(instances=instances)
    routing: dict[str, RoutingRequest] = {}
    seq = itertools.count()
    events: list = [(r.arrival, next(seq), "arrive", r) for r in requests if r.after is None]
    heapq.heapify(events)
    followers: dict[str, list[SimRequest]] = {}
    for r in requests:
        if r.after is not None:
            followers.setdefault(r.after, []).append(r)

    def start(inst: SimInstance) -> None:
        duration = inst.start_iteration()
        if duration is not None:
            heapq.heappush(events, (now[0] + duration, next(seq), "iteration", inst))

    def later(delay_s: float, kind: str, payload) -> None:
        heapq.heappush(events, (now[0] + delay_s, next(seq), kind, payload))

    legs = Legs(link, instances, loads, routing, start, later)

    def dispatch(req: SimRequest, arrival: float) -> None:
        params = SamplingParams(max_tokens=req.output_len)
        route = RoutingRequest(req.request_id, req.input_ids, params, chains=req.chains)
        decision = policy.select(route, loads)
        routing[req.request_id] = route
        loads[decision.instance].in_flight += 1
        result.records[req.request_id] = RequestRecord(
            arrival, decision.instance, decision.branch, prompt_len=len(req.input_ids)
        )
        if decision.prefill is not None and decision.prefill != decision.instance:
            result.records[req.request_id].prefill_instance = decision.prefill
            legs.dispatch(req, route, decision)
            return
        inst = instances[decision.instance]
        inst.add(req)
        if not inst.busy:
            start(inst)

    while events:
        now[0], _, kind, payload = heapq.heappop(events)
        if kind == "arrive":
            for req, arrival in routers.arrive(payload, now[0]) if routers else [(payload, now[0])]:
                dispatch(req, arrival)
            continue
        if kind == "received":
            legs.received(*payload)
            continue
        inst = payload
        first, done = inst.finish_iteration()
        for req in first:
            if req.request_id in result.records:  # (a prefill leg's token is not the answer's)
                result.records[req.request_id].first_token = now[0]
        for req in done:
            if req.request_id in legs.waiting:  # a prefill leg: its KV moves on
                loads[inst.index].in_flight -= 1
                info = FinishInfo(inst.cache.drain_events(), inst.stats(), None, 1)
                policy.on_finish(inst.index, routing.pop(req.request_id), info)
                legs.leg_done(req.request_id)
                continue
            record = result.records[req.request_id]
            record.finish, record.output_len = now[0], len(req.output_ids)
            record.cached_tokens = req.num_cached_tokens or 0
            loads[inst.index].in_flight -= 1
            load = inst.stats()
            loads[inst.index].reported = load
            ttft = (record.first_token or now[0]) - record.arrival
            info = FinishInfo(inst.cache.drain_events(), load, ttft, len(req.output_ids))
            policy.on_finish(inst.index, routing.pop(req.request_id), info)
            if learns:
                policy.calibrate(inst.index, inst.cost_report())
            for held, arrival in routers.finished(req.request_id, record) if routers else ():
                dispatch(held, arrival)
            for nxt in followers.pop(req.request_id, ()):
                heapq.heappush(events, (now[0] + nxt.think_s, next(seq), "arrive", nxt))
        start(inst)
    result.end_time, result.moved_tokens = now[0], legs.moved_tokens
    return result


def _refuse_oversized(requests: list[SimRequest], capacity: int) -> None:
    """A request whose prompt and output outgrow an instance's KV pool would wait forever
    (an engine refuses it: ``Engine.add_request``), and so would every turn after it: say
    so before the run, not with requests missing from its records."""
    for r in requests:
        if len(r.input_ids) + r.output_len > capacity:
            raise ValueError(
                f"request {r.request_id}: prompt plus output ({len(r.input_ids) + r.output_len} tokens) "
                f"exceeds an instance's KV pool ({capacity} tokens), so no engine would run it; "
                "raise the KV capacity (--capacity-tokens)"
            )


def metrics(result: SimResult, after: int = 0, slo: tuple[float, float] | None = None) -> dict[str, float]:
    """A run's record: latency (average, p50, p99), time to first token (average, p99),
    time per output token (average, p99), throughput and cache hit ratio
    (``docs/SCHEDULER.md``); of the requests after the first ``after`` to arrive (a policy
    that learns, once it has). ``slo``: (TTFT, TPOT) bounds in seconds; adds goodput, the
    share of requests that meet both, and the rate of those."""
    recs = sorted((r for r in result.records.values() if r.finish is not None), key=lambda r: r.arrival)
    recs = recs[after:]
    lat = np.array([r.finish - r.arrival for r in recs])
    ttft = np.array([r.first_token - r.arrival for r in recs])
    tpots = np.array([tpot(r) for r in recs if r.output_len > 1] or [0.0])
    span = max(r.finish for r in recs) - min(r.arrival for r in recs)
    out = {
        "num_requests": len(recs),
        "avg_latency_s": float(lat.mean()),
        "p50_latency_s": float(np.percentile(lat, 50)),
        "p99_latency_s": float(np.percentile(lat, 99)),
        "avg_ttft_s": float(ttft.mean()),
        "p99_ttft_s": float(np.percentile(ttft, 99)),
        "avg_tpot_s": float(tpots.mean()),
        "p99_tpot_s": float(np.percentile(tpots, 99)),
        "throughput_rps": len(recs) / span if span > 0 else 0.0,
        "cache_hit_ratio": sum(r.cached_tokens for r in recs) / max(1, sum(r.prompt_len for r in recs)),
    }
    if slo is not None:
        good = sum(r.first_token - r.arrival <= slo[0] and tpot(r) <= slo[1] for r in recs)
        out["goodput"] = good / len(recs)
        out["goodput_rps"] = good / span if span > 0 else 0.0
    return out


def tpot(r: RequestRecord) -> float:
    return (r.finish - r.first_token) / (r.output_len - 1) if r.output_len > 1 else 0.0
