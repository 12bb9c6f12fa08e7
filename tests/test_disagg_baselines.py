"""The anchors' prefill/decode rules (``scheduler/disagg_baselines.py``): Dynamo's
ISL-bounding rule and its prefill-load variant, llm-d's uncached-tokens decider and the
SGLang gateway's independent P and D, in the simulator and as the live router builds them;
every expected choice computed by hand."""

from __future__ import annotations

import pytest
from test_e2 import Clock, req

from preble_backend.common.cache_event import CacheEvent
from scheduler.disagg_baselines import DynamoPD, LlmdPD, SGLangPD
from scheduler.policy import Decision, InstanceLoad


def loads(n: int, in_flight=()) -> list[InstanceLoad]:
    out = [InstanceLoad() for _ in range(n)]
    for i, k in in_flight:
        out[i].in_flight = k
    return out


@pytest.mark.parametrize(
    "prompt, cached, expected",
    [(1000, 400, "local"), (1000, 0, "remote"), (5000, 4000, "local"), (5000, 2000, "remote")],
)
def test_dynamo_keeps_a_prefill_local_only_when_its_uncached_part_is_short(prompt, cached, expected):
    """Local when fewer than 2,048 tokens are uncached and they are under 70% of the
    prompt: 600 of 1,000 (60%) and 1,000 of 5,000 stay; 1,000 of 1,000 and 3,000 go."""
    policy = DynamoPD(3, ("prefill", "decode", "decode"), page_size=1, clock=Clock())
    tokens = list(range(prompt))
    policy.router.tree.apply_events(1, [CacheEvent.of("stored", tokens[:cached], 0, 1)] if cached else [])
    decision = policy.select(req(tokens), loads(3))
    assert decision.instance == 1 and decision.branch == expected  # (it holds the cached part, or ties first)
    assert decision.prefill == (0 if expected == "remote" else None)


def test_dynamos_prefill_load_variant_keeps_it_local_while_every_prefill_worker_is_busy():
    policy = DynamoPD(3, ("prefill", "decode", "decode"), prefill_queue=2, page_size=1, clock=Clock())
    assert policy.select(req(range(3000)), loads(3, [(0, 2)])).branch == "local_busy"
    assert policy.select(req(range(3000)), loads(3, [(0, 1)])).branch == "remote"


def test_llmd_picks_the_decode_pod_first_then_disaggregates_above_its_threshold():
    """Pod 2 holds 500 of the prompt: score 0.5 + 1 against pod 1's 0 + 1; from pod 2,
    500 tokens are uncached (≤ 512: local); a 1,100-token prompt leaves 600 (remote)."""
    policy = LlmdPD(3, ("prefill", "decode", "decode"), page_size=1, clock=Clock())
    policy.tree.apply_events(2, [CacheEvent.of("stored", list(range(500)), 0, 1)])
    assert policy.select(req(range(1000)), loads(3)) == Decision(2, "local")
    decision = policy.select(req(range(1100)), loads(3))
    assert (decision.instance, decision.branch, decision.prefill) == (2, "remote", 0)


def test_sglang_picks_prefill_and_decode_workers_apart_and_always_disaggregates():
    policy = SGLangPD(4, ("prefill", "prefill", "decode", "decode"), page_size=1, clock=Clock())
    decision = policy.select(req(range(10)), loads(4, [(0, 3)]))
    assert decision.branch == "pd" and decision.prefill == 1 and decision.instance in (2, 3)


@pytest.mark.parametrize(
    "name, remote, short_remote",
    [("dynamo_pd", "remote", True), ("llmd_pd", "remote", False), ("sglang_pd", "pd", True)],
)
def test_live_the_anchors_rules_learn_roles_from_the_engines_and_pair_only_engines_that_move_kv(
    name, remote, short_remote
):
    """Built by name as the router builds a policy (``policy: dynamo_pd``), each anchor's
    rule starts knowing no role: every engine is whole and nothing is paired. Once engine
    0 reports itself a prefill engine and 1 a decode engine, both moving KV, a 3,000-token
    uncached prompt decodes on 1 and prefills on 0; a 100-token one stays on 1 for llm-d
    only (512 uncached tokens or fewer), where Dynamo keeps a prefill local only when
    under 2,048 uncached tokens are also under 70% of the prompt, and SGLang's gateway
    always pairs. An engine of another KV shape (2) is never paired; a decode engine that
    joins later is, once it reports its role."""
    from scheduler.policies import ALL_POLICIES, make_policy

    assert name not in ALL_POLICIES  # named, never in "all": they need a P/D stack
    policy = make_policy(name, 3, {"page_size": 1, "clock": Clock()})
    loads = [InstanceLoad() for _ in range(3)]
    long, short = req(list(range(3000))), req(list(range(5000, 5100)))
    assert policy.select(long, loads).prefill is None  # no engine reported a role yet
    policy.learn(0, {"role": "prefill", "kv_bytes_per_token": 1000})
    policy.learn(1, {"role": "decode", "kv_bytes_per_token": 1000})
    policy.learn(2, {"role": "decode", "kv_bytes_per_token": 2000})
    assert policy.roles == ["prefill", "decode", "decode"] and policy.movable == {0, 1}
    policy.instance_down(2)
    assert policy.select(long, loads) == Decision(1, remote, prefill=0)
    paired, local = Decision(1, remote, prefill=0), Decision(1, "local")
    assert policy.select(short, loads) == (paired if short_remote else local)
    policy.instance_up(2)
    policy.instance_down(1)
    decision = policy.select(long, loads)
    assert decision.instance == 2 and decision.prefill is None  # 2 cannot take 0's pages
    joined = policy.add_instance()  # a decode engine joins: the rule and its own router grow
    policy.learn(joined, {"role": "decode", "kv_bytes_per_token": 1000})
    policy.instance_up(joined)
    policy.instance_down(2)
    assert policy.select(long, loads + [InstanceLoad()]) == Decision(joined, remote, prefill=0)
