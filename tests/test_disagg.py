"""Prefill/decode disaggregation priced as a whole (``scheduler/disagg.py``) and the
simulator's P/D model: every expected choice computed by hand (the anchors' rules:
``test_disagg_baselines.py``)."""

from __future__ import annotations

from math import ceil

import pytest
from test_e2 import Clock, req
from test_e2_batch import BATCH

from preble_backend.common.cache_event import CacheEvent
from preble_backend.common.cost_model import CostModel
from preble_backend.common.settings import check_roles
from scheduler.disagg import E2PD, LEG, KVLink, prefill_leg
from scheduler.disagg_baselines import SGLangPD
from scheduler.policy import Decision, FinishInfo, InstanceLoad
from scheduler.sim.simulator import SimConfig, SimRequest, metrics, simulate

# 1 ms per token moved (1,000 bytes per token at 1,000 bytes per ms), after 2 ms
SLOW_LINK = KVLink(bandwidth_gbps=1e-3, latency_ms=2.0, kv_bytes_per_token=1000)


@pytest.mark.parametrize(
    "roles, message",
    [
        (("prefill", "decoder"), "engine role 'decoder' is invalid"),
        (("decode",), "need two engines or more"),
        (("prefill", "prefill"), "no engine decodes"),
        (("decode", "decode"), "decode engines without a prefill role anywhere"),
    ],
)
def test_layouts_that_cannot_serve_are_refused_by_name(roles, message):
    with pytest.raises(ValueError, match=message):
        check_roles(roles)
    check_roles(("both",))  # one engine without roles serves as ever
    check_roles(("prefill", "decode", "both"))


def test_a_transfer_costs_its_latency_plus_bytes_over_bandwidth():
    link = KVLink(bandwidth_gbps=25.0, latency_ms=1.5, kv_bytes_per_token=131072)
    assert link.transfer_ms(0) == 0.0
    assert link.transfer_ms(4096) == pytest.approx(1.5 + 4096 * 131072 / 25e6)  # 4k tokens of 8B: 23 ms


def pd_pair(b: int) -> tuple[E2PD, Clock]:
    """Instance 0 prefills, instance 1 decodes and runs ``b`` requests fully cached."""
    clock = Clock()
    policy = E2PD(2, ("prefill", "decode"), SLOW_LINK, cost_model=BATCH, capacity_tokens=10_000,
                  clock=clock, page_size=1)  # fmt: skip
    for k in range(b):
        policy.history[1].add(f"busy{k}", 0.0, 0.0, 1.0, 1000)
    return policy, clock


@pytest.mark.parametrize(
    "b, m, expected",
    [(0, 100, "aggregated"), (1, 100, "aggregated"), (2, 100, "aggregated"), (3, 2, "aggregated"),
     (3, 3, "disaggregate"), (4, 100, "disaggregate")],
)  # fmt: skip
def test_e2_disaggregates_when_the_prefill_would_cost_the_decodes_more_than_the_transfer(b, m, expected):
    """A prompt of ``m`` tokens nobody caches. Aggregated on the decode instance it costs
    48·b (its batch: 32 steps each b ms longer, and 16 of theirs it lengthens by 1 ms
    each, ``test_e2_batch``) + m·(1 + b) (its prefill, waited for by the b decoding).
    Disaggregated: m on the idle prefill instance, the transfer 2 + m, the same 48·b on
    the decode instance, and m for the copy it leaves there. So it moves when 2 + 2m < m·b:
    never at b ≤ 2; at b = 3 from m = 3 (a tie at m = 2 stays)."""
    policy, _ = pd_pair(b)
    r = req(range(m))
    decision = policy.select(r, [InstanceLoad(), InstanceLoad()])
    assert decision.instance == 1
    if expected == "aggregated":
        assert decision.prefill is None and decision.branch != "disaggregate"
        assert r.request_id in policy.history[1].in_flight and not policy.history[0].in_flight
        return
    assert (decision.branch, decision.prefill) == ("disaggregate", 0)
    # the prefill is counted on P (m ms for m tokens), the decode on D with nothing to prefill there
    assert policy.history[0].in_flight == {
        r.request_id + LEG: (m, 0.0, m, False, m, 0)
    }  # a leg: it does not decode
    assert policy.history[1].in_flight[r.request_id] == (0.0, 1.0, m, True, 0, 0)


def test_what_the_decode_instance_caches_is_not_moved_and_not_priced():
    """D already holds 80 of a 100-token prompt and runs 3 requests: aggregated costs
    48·3 + 20·4 = 224; disaggregated 100 (P holds nothing) + 2 + 20 (only what D lacks
    moves) + 144 + 20 (the copy of what it lacks) = 286, so it stays; with P holding it
    too, 20 + 22 + 144 + 20 = 206 < 224."""
    tokens = list(range(100))
    for p_holds, expected in ((False, None), (True, 0)):
        policy, _ = pd_pair(3)
        policy.tree.apply_events(1, [CacheEvent.of("stored", tokens[:80], 0, 1)])
        if p_holds:
            policy.tree.apply_events(0, [CacheEvent.of("stored", tokens[:80], 0, 1)])
        match = policy.tree.match(req(tokens).chain(1))
        assert policy.load_cost(1, match, 100, 0.0) == 224
        assert policy.decode_leg_cost(1, match, 100, 0.0) == 22 + 144 + 20
        assert policy.select(req(tokens), [InstanceLoad(), InstanceLoad()]).prefill == expected


def test_d_holds_a_disaggregated_prompt_from_its_leg_s_end_so_followers_are_not_sent_to_recompute_it():
    """D runs 4 requests; a 100-token prompt nobody caches disaggregates (P 0, D 1). Until
    its leg ends only P holds the prompt: a second request with it, priced on D as a miss
    (100 · 6 for its prefill, waited for by the five decoding there, + 48 · 5 = 840, where
    with D counted as holding it 240 won and D computed it again), goes to P's cache too.
    The leg's end routes the first on D; a request that ends before its leg is uncounted."""
    policy, _ = pd_pair(4)
    first, second = req(range(100)), req(range(100))
    assert policy.select(first, [InstanceLoad(), InstanceLoad()]) == Decision(1, "disaggregate", prefill=0)
    match = policy.tree.match(first.chain(1))
    assert (match.cached_on(0), match.cached_on(1)) == (100, 0)
    assert policy.history[1].in_flight[first.request_id] == (0.0, 1.0, 100, True, 0, 0)  # on D now
    assert policy.load_cost(1, match, 100, 0.0) == 840
    assert policy.select(second, [InstanceLoad(), InstanceLoad()]) == Decision(1, "disaggregate", prefill=0)
    policy.on_finish(0, prefill_leg(first), FinishInfo())
    assert policy.tree.match(first.chain(1)).cached_on(1) == 100
    policy.on_finish(1, first, FinishInfo())
    assert first.request_id not in policy.history[1].in_flight
    policy.on_finish(1, second, FinishInfo())  # it ended (cancelled) before its leg did
    assert second.request_id not in policy.history[1].in_flight
    policy.on_finish(0, prefill_leg(second), FinishInfo())
    assert not policy.history[0].in_flight and not policy._arriving
    assert policy.tree.match(first.chain(1)).cached_on(1) == 0  # nothing pending, nothing stored


def test_a_prefill_leg_is_paid_for_by_the_requests_decoding_where_it_prefills():
    """Every instance ``both``. Instance 0 runs 8 requests whose prefills (100 ms each) are
    in flight, instance 1 runs 6 fully cached. A 300-token prompt nobody caches:
    aggregated on 1 costs 48·6 + 300·7 = 2,388 (on 0, 1,184 + 300·(1 + 6.095) = 3,313). Of
    0's 8 requests 8·320 / (320 + 100) = 6.095 are expected to decode (DECODETIME of the
    window's 32 tokens against their mean prefill), and they wait for a leg's prefill there
    as for any other's: a leg on 0 costs 800 queued + 8 + 4 (its one step) + 300·7.095 =
    2,941, so P is instance 1 (2,109) and the pair, with D = 0 (1,786), costs more than
    aggregated. Priced at the leg's own one-token DECODETIME, 0's decoders looked like
    8·10 / (10 + 100) = 0.73 requests, the leg 1,330, and the prompt prefilled on 0 beside
    its decodes (70B, flexible roles, multi-tenant at stress: their TPOT went from 67 to
    101 ms against a 100 ms bound, docs/benchmarks/disagg.md, "A leg's price on an
    instance that decodes")."""
    policy = E2PD(2, ("both", "both"), SLOW_LINK, cost_model=BATCH, capacity_tokens=10_000,
                  clock=Clock(), page_size=1)  # fmt: skip
    for k in range(8):
        policy.history[0].add(f"prefilling{k}", 0.0, 100.0, 0.0, 1000)
    for k in range(6):
        policy.history[1].add(f"busy{k}", 0.0, 0.0, 1.0, 1000)
    r = req(range(300))
    match = policy.tree.match(r.chain(1))
    assert policy.history[0].decoding(320) == pytest.approx(8 * 320 / 420)
    assert [policy.load_cost(i, match, 300, 0.0) for i in (0, 1)] == pytest.approx(
        [1184 + 300 * (1 + 8 * 320 / 420), 2388]
    )
    assert policy.load_cost(0, match, 300, 0.0, decode_len=1.0) == pytest.approx(
        812 + 300 * (1 + 8 * 320 / 420)
    )
    assert policy.load_cost(1, match, 300, 0.0, decode_len=1.0) == 9 + 300 * 7
    assert policy.decode_leg_cost(0, match, 300, 0.0) == 2 + 300 + 1184 + 300
    assert policy.select(r, [InstanceLoad(), InstanceLoad()]) == Decision(1, "explore")
    decoding = policy.history[1].decoding(320)  # its 6 and the request
    policy.history[1].add("another" + LEG, 0.0, 300.0, 0.0, 300, decodes=False)
    assert policy.history[1].decoding(320) == decoding  # a leg in flight never decodes


def test_a_prefill_only_instance_pays_the_base_of_every_chunk_s_pass():
    """With nothing decoding beside them, a prefill instance runs each ``chunk_size``
    tokens of a prompt as a pass of its own, each paying the base (5 ms here): 250 tokens
    in chunks of 100 take 3 passes, 15 + 250 ms. Where requests decode, the chunks share
    their passes and PREFILLTIME is the cost model's, one base. The chunk is the engine's
    own, from its report; P's queue counts the leg at that price."""
    cost = CostModel(base_ms=5, prefill_ms_per_token=1, decode_ms_per_request=1,
                     attention_ms_per_context_token=0, decode_step_ms=10)  # fmt: skip
    policy = E2PD(2, ("prefill", "decode"), SLOW_LINK, cost_model=cost, capacity_tokens=10_000,
                  clock=Clock(), page_size=1)  # fmt: skip
    assert policy.prefill_time(0, 250) == 5 * ceil(250 / 512) + 250  # until it reports its chunk
    for i in (0, 1):
        policy.learn(i, {"kv_pages_total": 10_000, "page_size": 1, "chunk_size": 100})
    assert policy.prefill_time(0, 250) == 15 + 250
    assert policy.prefill_time(0, 100) == 5 + 100
    assert policy.prefill_time(1, 250) == 5 + 250
    for k in range(4):  # D decodes 4 fully cached requests: the 250-token prompt moves
        policy.history[1].add(f"busy{k}", 0.0, 0.0, 1.0, 1000)
    r = req(range(250))
    assert policy.select(r, [InstanceLoad(), InstanceLoad()]).prefill == 0
    assert policy.history[0].in_flight[r.request_id + LEG][0] == 265


def test_a_prefill_leg_does_not_shorten_the_average_decoding_length():
    policy, _ = pd_pair(3)
    r = req(range(100))
    assert policy.select(r, [InstanceLoad(), InstanceLoad()]).branch == "disaggregate"
    leg = next(iter(policy.history[0].in_flight))
    policy.on_finish(0, type(r)(leg, r.input_ids, r.params), FinishInfo(num_output_tokens=1))
    assert not policy.history[0].in_flight and policy.decode_lengths.average(0.0) == 32  # the default still


COST = CostModel(base_ms=1, prefill_ms_per_token=0.1, decode_ms_per_request=0.2,
                 attention_ms_per_context_token=0, decode_step_ms=5)  # fmt: skip


def test_the_simulator_runs_disaggregated_requests_and_moves_only_what_decode_lacks():
    """Three requests sharing a 64-token prefix, prefilled on instance 0 and decoded on
    instance 1 (SGLang's rule always splits): the first moves its 64 + 16 whole pages'
    tokens, later ones only their own 16 (and the last partial page is computed on D).
    Every request decodes all its tokens on D, its first token after the transfer; every
    page is back in the pool or the radix cache."""
    shared = list(range(64))
    reqs = [SimRequest(f"q{i}", i * 1.0, shared + list(range(100 * (i + 1), 100 * (i + 1) + 20)), 8)
            for i in range(3)]  # fmt: skip
    cfg = SimConfig.of(2, capacity_tokens=4096, page_size=16)
    link = KVLink(bandwidth_gbps=1e-3, latency_ms=5.0, kv_bytes_per_token=1000)
    policy = lambda c: SGLangPD(2, ("prefill", "decode"), page_size=16, clock=c)  # noqa: E731
    result = simulate(reqs, policy, cfg, COST, link)
    assert result.moved_tokens == 80 + 16 + 16
    for r in result.records.values():
        assert (r.instance, r.prefill_instance, r.branch, r.output_len) == (1, 0, "pd", 8)
        assert r.first_token > r.arrival + 0.005 + 16e-3  # after P's prefill and at least 16 tokens moved
    for inst in result.instances:
        assert not inst.scheduler.running and not inst.scheduler.waiting
        assert inst.pool.num_free + inst.cache.num_pages == inst.pool.num_pages
    m = metrics(result, slo=(10.0, 1.0))
    assert m["num_requests"] == 3 and m["goodput"] == 1.0 and m["p99_tpot_s"] >= m["avg_tpot_s"] > 0
    assert metrics(result, slo=(0.0, 1.0))["goodput"] == 0.0


def test_live_the_router_s_e2_learns_roles_and_pairs_only_engines_that_move_kv():
    """``make_policy("e2")`` is E2PD without given roles: E2 exactly until engines report
    roles; then aggregated work goes only where it can decode, and a pair forms only
    between engines that reported they move KV, at the bandwidth they measured."""
    from scheduler.e2 import E2
    from scheduler.policies import make_policy

    facts = {"page_size": 1, "capacity_tokens": 10_000, "cost_model": BATCH}
    live, plain = make_policy("e2", 3, facts), E2(3, **facts)
    assert live.name == "e2"
    prompts = [[7, 8, 9, i % 3, i] for i in range(12)]
    loads = [InstanceLoad() for _ in range(3)]
    assert [live.select(req(p), loads) for p in prompts] == [plain.select(req(p), loads) for p in prompts]

    policy = make_policy("e2", 3, facts)
    snapshot = {"kv_pages_total": 10_000, "page_size": 1}
    policy.learn(0, {**snapshot, "role": "prefill"})  # no kv_bytes_per_token: it cannot move KV
    policy.learn(1, {**snapshot, "role": "decode", "kv_bytes_per_token": 1000, "kv_transfer_gbps": 2.5})
    assert policy.roles == ["prefill", "decode", "both"] and policy.movable == {1}
    assert policy.link == KVLink(2.5, 1.0, 1000)
    decisions = [policy.select(req([9, 9, i]), loads) for i in range(6)]
    assert {d.instance for d in decisions} <= {1, 2} and all(d.prefill is None for d in decisions)
    policy.learn(0, {**snapshot, "role": "prefill", "kv_bytes_per_token": 1000})
    assert policy.movable == {0, 1} and policy.link.bandwidth_gbps == 2.5  # measured, kept


@pytest.mark.parametrize(
    "overrides, message",
    [({"role": "decoder"}, "role='decoder' is invalid"),
     ({"role": "decode", "enable_prefix_caching": False}, "without the prefix cache"),
     ({"kv_transfer": True, "enable_prefix_caching": False}, "kv_transfer=true is invalid without")],
)  # fmt: skip
def test_an_engine_role_the_handoff_cannot_serve_is_refused_at_load(overrides, message):
    from preble_backend.engine.config import EngineConfig

    with pytest.raises(ValueError, match=message):
        EngineConfig(model_path="tiny", **overrides)
    EngineConfig(model_path="tiny", role="decode", host_kv_tokens=64)  # a host tier: its device pages move


def test_live_engines_that_both_serve_and_move_kv_are_paired_either_way():
    """Engines of the role ``both`` with ``kv_transfer`` report the KV they move, and E2
    pairs any two. Engine 0 holds a 100-token prompt and decodes 40 requests (fully cached,
    100 tokens each), engine 1 decodes 4. Aggregated, E2 exploits 0's cache: 32·40 + 40·16
    = 1,920. A leg on 0 costs its one step, 40 + 40/2 = 60; on 1 the transfer (1 ms, and
    100 tokens of 1,000 bytes at 1,000 GB/s), 48·4 = 192 and the copy's 100: a pair at
    ~353 is the cheaper. Before the engines report that they move KV, nothing pairs."""
    from scheduler.policies import make_policy

    def cluster(reported: bool):
        policy = make_policy("e2", 2, {"page_size": 1, "capacity_tokens": 10_000, "cost_model": BATCH})
        policy.tree.apply_events(0, [CacheEvent.of("stored", prompt, 0, 1)])
        for i, b in ((0, 40), (1, 4)):
            for k in range(b):
                policy.history[i].add(f"busy{i}-{k}", 0.0, 0.0, 1.0, 100)
            if reported:
                policy.learn(i, {"kv_pages_total": 10_000, "page_size": 1, "role": "both",
                                 "kv_bytes_per_token": 1000, "kv_transfer_gbps": 1000.0})  # fmt: skip
        return policy

    prompt, loads = list(range(100)), [InstanceLoad(), InstanceLoad()]
    assert cluster(False).select(req(prompt), loads) == Decision(0, "exploit")
    policy = cluster(True)
    assert policy.roles == ["both", "both"] and policy.movable == {0, 1}
    match = policy.tree.match(req(prompt).chain(1))
    assert policy.load_cost(0, match, 100, 0.0) == 1920
    assert policy.load_cost(0, match, 100, 0.0, decode_len=1.0) == 60
    assert policy.decode_leg_cost(1, match, 100, 0.0) == pytest.approx(1.0001 + 192 + 100)
    assert policy.select(req(prompt), loads) == Decision(1, "disaggregate", prefill=0)


def test_live_an_engine_of_another_kv_shape_is_never_paired_and_a_prefill_engine_serves_alone(caplog):
    from scheduler.policies import make_policy

    policy = make_policy("e2", 4, {"page_size": 1, "capacity_tokens": 10_000, "cost_model": BATCH})
    snapshot = {"kv_pages_total": 10_000, "page_size": 1}
    two = {**snapshot, "kv_ranks": 2}
    policy.learn(0, {**two, "role": "prefill", "kv_bytes_per_token": 1000})
    policy.learn(1, {**two, "role": "decode", "kv_bytes_per_token": 1000})
    policy.learn(2, {**two, "role": "decode", "kv_bytes_per_token": 2000})  # another dtype or model
    policy.learn(3, {**snapshot, "role": "decode", "kv_bytes_per_token": 1000})  # one rank: cut otherwise
    assert policy.movable == {0, 1} and "instance 2's KV takes 2000 bytes per token over 2" in caplog.text
    assert "instance 3's KV takes 1000 bytes per token over 1 ranks, the others' 1000 over 2" in caplog.text
    loads = [InstanceLoad() for _ in range(4)]
    for down in (1, 2, 3):
        policy.instance_down(down)
    assert policy.select(req([4, 5, 6]), loads) == Decision(0, "explore")  # no decode engine is up
