"""E2 P/D told the operator's bounds (``tpot_slo_ms``, ``ttft_slo_ms``): each expected
choice computed by hand on the two-instance cluster of ``test_disagg.py``."""

from __future__ import annotations

import math

import pytest
from test_disagg import SLOW_LINK, pd_pair
from test_e2 import Clock, req
from test_e2_batch import BATCH

from scheduler.disagg import E2PD, KVLink
from scheduler.disagg_baselines import DynamoPD
from scheduler.policy import InstanceLoad


@pytest.mark.parametrize(
    "b, m, slo_ms, expected",
    [(1, 100, 0.0, None), (1, 100, 2.03, None), (1, 100, 2.02, 0), (1, 5000, 4.01, None), (1, 5000, 3.99, 0),
     (0, 100, 0.001, None)],
)  # fmt: skip
def test_with_a_tpot_slo_e2_prefills_nothing_where_the_decodes_would_miss_it(b, m, slo_ms, expected):
    """At b = 1, E2 alone keeps an uncached prompt on the decode instance (48 + 2m against
    m + 2 + m + 48). Told a TPOT SLO, it first prices the TPOT of D's decodes with the
    prompt prefilling there: a step of D's batch with it (b + 1 requests at 1 ms, no base,
    no attention: 2 ms) stretched by the share of D's time prefills take within the window
    (D's requests came 10 s ago, prefilling nothing; this one m ms): 2 / (1 - m / 10,000),
    2.0202 ms at m = 100 and 4 ms at m = 5,000. Above the SLO the prompt prefills on P;
    with nothing decoding on D no SLO is at stake."""
    policy, clock = pd_pair(b)
    policy.tpot_slo_ms = slo_ms
    clock.t = 10.0
    match = policy.tree.match(req(range(m)).chain(1))
    if b:
        assert policy.tpot_with_prefill(1, match, m, 10.0) == pytest.approx(2 / (1 - m / 10_000))
    assert policy.select(req(range(m)), [InstanceLoad(), InstanceLoad()]).prefill == expected


@pytest.mark.parametrize("slo_ms, expected", [(0.0, None), (2.02, 0), (1.0, None)])
def test_with_a_tpot_slo_no_leg_prefills_where_the_decodes_would_miss_it(slo_ms, expected):
    """Every instance ``both``; 1 request decodes on 0, 3 on 1 (fully cached, 10 s ago); a
    100-token prompt nobody caches. Aggregated on 0 costs 48 + 100·2 = 248; the pair (a leg
    on 0, 1.5 + 100·2, and on 1 2 + 100 + 48·3 + 100) 547.5. Told a TPOT SLO, E2 prices the
    TPOT of the decodes beside each prefill: on 0 with the request in its batch 2 / (1 -
    100/10,000) = 2.02 ms, with a leg that leaves 1.01 ms; a leg on 1 3.03 ms. At 2.02 the
    aggregated choice misses it and the leg on 0 does not: the pair. At 1.0 both miss it,
    and the request stays aggregated: no prefill meets the bound, so the price decides."""
    policy = E2PD(2, ("both", "both"), SLOW_LINK, cost_model=BATCH, capacity_tokens=10_000, clock=Clock(),
                  page_size=1, tpot_slo_ms=slo_ms)  # fmt: skip
    for i, b in ((0, 1), (1, 3)):
        for k in range(b):
            policy.history[i].add(f"busy{i}-{k}", 0.0, 0.0, 1.0, 1000)
    policy.clock.t = 10.0
    match = policy.tree.match(req(range(100)).chain(1))
    assert policy.tpot_with_prefill(0, match, 100, 10.0) == pytest.approx(2 / 0.99)
    assert policy.tpot_with_prefill(0, match, 100, 10.0, joins=False) == pytest.approx(1 / 0.99)
    decision = policy.select(req(range(100)), [InstanceLoad(), InstanceLoad()])
    assert (decision.instance, decision.prefill) == ((1, 0) if expected == 0 else (0, None))


@pytest.mark.parametrize("slo_ms, expected", [(0.0, 0), (50.0, 0), (150.0, None), (300.0, 0)])
def test_with_a_ttft_slo_e2_keeps_the_request_whole_where_only_that_meets_it(slo_ms, expected):
    """b = 4, m = 100: E2 alone pairs (2 + 2m < m·b, test_disagg.py). The first token whole on D: no
    prefill queued there, its own 100 ms in one chunk pass (100 < 512) that also runs a
    decode step of D's 4 requests (4 ms, no base): 104 ms. As a pair: 100 on the idle P,
    then the transfer of 100 tokens, 2 + 100: 202 ms. Told 150 ms, only the aggregated
    choice meets it; told 50 neither does and told 300 both do, and the price decides."""
    policy, _ = pd_pair(4)
    policy.ttft_slo_ms = slo_ms
    match = policy.tree.match(req(range(100)).chain(1))
    assert policy.ttft_aggregated(1, match, 100, 0.0) == pytest.approx(104.0)
    assert policy.ttft_disaggregated(0, 1, match, 100, 0.0) == pytest.approx(202.0)
    assert policy.select(req(range(100)), [InstanceLoad(), InstanceLoad()]).prefill == expected


def test_with_a_ttft_slo_no_first_token_is_promised_on_a_decode_instance_out_of_room():
    """As above (b = 4, m = 100, told 150 ms), with D's KV 4,000 tokens: its 4 requests hold
    (4,000 + 4 · 32) / 4 = 1,032 tokens each at the default decoding length, and beside this
    prompt's 132 room is left for 4,000 - 132 = 3,868 of theirs, 3.75 requests: it would
    wait for one to finish. Neither way meets the bound then, and the price pairs it."""
    policy, _ = pd_pair(4)
    policy.capacity[1] = 4000
    policy.ttft_slo_ms = 150.0
    match = policy.tree.match(req(range(100)).chain(1))
    assert policy.ttft_aggregated(1, match, 100, 0.0) == math.inf
    assert policy.ttft_disaggregated(0, 1, match, 100, 0.0) == math.inf
    assert policy.select(req(range(100)), [InstanceLoad(), InstanceLoad()]).prefill == 0


@pytest.mark.parametrize("slo_ms, expected", [(0.0, None), (300.0, 0), (1000.0, None)])
def test_with_a_ttft_slo_e2_pairs_where_only_the_pair_meets_it(slo_ms, expected):
    """Nothing decodes on D, where 600 ms of prefill was routed this instant; P is idle and
    the link fast (0.001 ms a token after 2 ms). A 100-token prompt: whole on D it waits
    the 600 ms and prefills 100, with nothing decoding beside: 700 ms; as a pair, 100 on P
    and 2 + 0.1 for the transfer: 102.1 ms. E2 alone keeps it whole: the pair pays the
    same 600 ms ahead of it on D (it decodes there) and the copy's PREFILLTIME on top.
    Told 300 ms, only the pair meets it; told 1,000 both do."""
    fast = KVLink(bandwidth_gbps=1.0, latency_ms=2.0, kv_bytes_per_token=1000)
    policy = E2PD(2, ("prefill", "decode"), fast, cost_model=BATCH, capacity_tokens=10_000, clock=Clock(),
                  page_size=1, ttft_slo_ms=slo_ms)  # fmt: skip
    policy.history[1].add("queued", 0.0, 600.0, 0.0, 600, decodes=False)
    match = policy.tree.match(req(range(100)).chain(1))
    assert policy.ttft_aggregated(1, match, 100, 0.0) == pytest.approx(700.0)
    assert policy.ttft_disaggregated(0, 1, match, 100, 0.0) == pytest.approx(102.1)
    assert policy.select(req(range(100)), [InstanceLoad(), InstanceLoad()]).prefill == expected


def test_the_routers_slos_reach_e2_and_only_the_policies_that_take_them():
    """``tpot_slo_ms`` and ``ttft_slo_ms`` in the router's config.pbtxt are cluster facts:
    the live e2 (and a policy switched to at run time) is built with them; the anchors'
    rules ignore them."""
    from preble_backend.router.config import RouterConfig
    from scheduler.policies import make_policy

    facts = RouterConfig.from_strings({"tpot_slo_ms": "40"}).policy_facts()
    assert make_policy("e2", 2, facts).tpot_slo_ms == 40.0
    assert make_policy("e2", 2, RouterConfig().policy_facts()).tpot_slo_ms == 0
    ttft = RouterConfig.from_strings({"ttft_slo_ms": "2000"}).policy_facts()
    assert make_policy("e2", 2, ttft).ttft_slo_ms == 2000.0
    assert isinstance(make_policy("dynamo_pd", 2, facts), DynamoPD)
