"""Routers that hold requests in the simulator (``scheduler/sim/router_tier.py``): the
anchors' router-local fairness, worked by hand, and the collapse Dynamo's own design note
shows (a 4:1 split near 1:1 with two routers and skewed traffic) against one counter for
the cluster, which keeps it."""

from __future__ import annotations

import zlib

import pytest

from preble_backend.common.cost_model import CostModel
from preble_backend.common.fair_share import TenantShares
from scheduler.policies import make_policy
from scheduler.sim.fairness_bench import max_min_allocation, max_min_index, mean_tpot, served_by, tpot_floor
from scheduler.sim.router_tier import RouterTier, SimRouter
from scheduler.sim.simulator import RequestRecord, SimConfig, SimRequest, simulate
from scheduler.sim.sweep import cluster_facts


def req(name: str, tenant: str, arrival: float = 0.0, router: int = 0) -> SimRequest:
    """A 100-token prompt of its own (no cache hits) and 8 tokens out."""
    first = 10 + 100 * (zlib.crc32(name.encode()) % 10_000)
    return SimRequest(name, arrival, list(range(first, first + 100)), 8, tenant=tenant, router=router)


@pytest.mark.parametrize(("rule", "after_a1"), [("fcfs", "a2"), ("rr", "b1"), ("drr", "b1"), ("vtc", "b1")])
def test_a_router_holds_what_is_over_its_inflight_and_orders_it_by_its_rule(rule, after_a1):
    """One slot. a1 goes at once; a2 then b1 wait. When a1 ends, fcfs takes a2 (it came
    first); per-tenant turns, deficit round-robin (b's turn, its 100-token prompt within a
    quantum) and VTC (a was charged a1's 100 prompt tokens and 8 output ×2, b nothing)
    take b1."""
    router = SimRouter(rule, max_inflight=1)
    assert [r.request_id for r, _ in router.arrive(req("a1", "a"), 0.0)] == ["a1"]
    assert router.arrive(req("a2", "a"), 1.0) == [] and router.arrive(req("b1", "b"), 2.0) == []
    nxt = router.finished("a", computed=100, cached=0, output=8)
    assert [(r.request_id, t) for r, t in nxt] == [(after_a1, 1.0 if after_a1 == "a2" else 2.0)]
    assert router.inflight == 1 and len(router.queue) == 1
    if rule == "vtc":
        assert router.shares.service("a") == 100 + 2 * 8


def test_an_unknown_rule_is_refused_by_name():
    with pytest.raises(ValueError, match="router rule 'wfq' is unknown"):
        SimRouter("wfq", 1)


def shares_by_tenant(routers: RouterTier | None, fair: bool, weights: dict[str, float]) -> dict[str, float]:
    """Tenant a (weight 4) on router 0 alone, b (weight 1) on router 1 alone, both far over
    one instance's capacity; each tenant's service until arrivals end."""
    cost = CostModel.load("mistral7b_a6000")
    requests = [req(f"{t}{i}", t, arrival=i * 0.01, router=int(t == "b")) for i in range(300) for t in "ab"]
    cfg = SimConfig.of(1, 4_000, fair_share=fair)
    shares = TenantShares(weights=dict(weights)) if fair else None

    def e2(clock):
        return make_policy("e2", 1, cluster_facts(cfg, cost, clock))

    result = simulate(requests, e2, cfg, cost, shares=shares, routers=routers)
    until = max(r.arrival for r in requests)
    out = {"a": 0.0, "b": 0.0}
    for r in requests:
        out[r.tenant] += served_by(result.records[r.request_id], r.output_len, until)
    return out


def test_router_local_shares_collapse_to_one_to_one_where_one_counter_keeps_four_to_one():
    weights = {"a": 4.0, "b": 1.0}
    local = shares_by_tenant(RouterTier(2, "vtc", max_inflight=4, weights=weights), False, weights)
    ours = shares_by_tenant(None, True, weights)
    assert 0.8 < local["a"] / local["b"] < 1.25  # each router gives its one tenant all its slots
    assert 3.4 < ours["a"] / ours["b"] < 4.6


def test_max_min_shares_owe_a_light_tenant_what_it_asks_and_split_the_rest_alike():
    """60 units among demands 10, 30 and 100: 10 to the first (less than a third), then
    25 each; a tenant short of its max-min share lowers the index."""
    demand = {"light": 10.0, "mid": 30.0, "heavy": 100.0}
    assert max_min_allocation(demand, 60.0) == {"light": 10.0, "mid": 25.0, "heavy": 25.0}
    assert max_min_index({"light": 10.0, "mid": 25.0, "heavy": 25.0}, demand) == pytest.approx(1.0)
    assert max_min_index({"light": 5.0, "mid": 25.0, "heavy": 30.0}, demand) < 0.95


def test_the_tpot_floor_is_the_least_mean_pass_at_the_work_served():
    """Base 10 ms, 1 ms per prompt or output token. Over a 1 s span instance 0 computed 380
    prompt tokens (20 more cached) and 50 output: 430 ms of per-token work, so at most
    (1000 - 430) / 10 = 57 passes, a mean pass of at least 10 / 0.57 = 17.5 ms; instance 1
    computed 150 output tokens: 10 / 0.85 = 11.8 ms. Light tokens decoded 50 on the first
    and 150 on the second: (17.5 * 50 + 11.8 * 150) / 200. The light requests' own mean
    time per token after the first: (0.49 s / 49 + 0.298 s / 149) / 2."""
    cost = CostModel(base_ms=10.0, prefill_ms_per_token=1.0, decode_ms_per_request=1.0,
                     attention_ms_per_context_token=0.0, decode_step_ms=10.0)  # fmt: skip
    busy = RequestRecord(0.0, instance=0, first_token=0.1, finish=0.59, prompt_len=400, cached_tokens=20,
                         output_len=50)  # fmt: skip
    other = RequestRecord(0.0, instance=1, first_token=0.2, finish=0.498, prompt_len=0, output_len=150)
    floor = tpot_floor([busy, other], [busy, other], 2, cost, span=1.0)
    assert floor == pytest.approx((10 / 0.57 * 50 + 10 / 0.85 * 150) / 200 / 1000)
    assert mean_tpot([busy, other]) == pytest.approx((0.49 / 49 + 0.298 / 149) / 2)
