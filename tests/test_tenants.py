"""Tenants named by API key (issue 65): the keys file refused by line, a tenant that cannot
name another, caps that answer 429, the request parameters the router and engines read,
and one counter for the cluster carried by health probes between routers and engines."""

from __future__ import annotations

import asyncio
import json

import numpy as np
import pytest

from preble_backend.common.fair_share import DEFAULT_TENANT, TenantShares, jain_index
from preble_backend.common.tenants import GATEWAY, KeysFileError, Tenant, TenantKeys, TenantRefused
from preble_backend.engine.config import EngineConfig
from preble_backend.engine.engine import Engine
from preble_backend.engine_server.tenant_ledger import TenantLedger
from preble_backend.frontend.tenant_gate import TenantGate
from preble_backend.router.cluster.tenant_shares import ClusterShares
from preble_backend.router.requests.flights import Flights
from preble_backend.router.requests.token_budgets import RateLimited, TokenBudgets
from preble_backend.serving.protocol import (
    BadRequest,
    parse_engine_call,
    parse_generate,
    rate_limited,
    retry_after,
    retryable,
)

KEY_A, KEY_B, KEY_C = "sk-team-a-0123456789", "sk-team-b-0123456789", "sk-team-c-0123456789"
KEY_GW = "sk-gw-0123456789ab"
GOOD = f"""# key  tenant  weight  options
{KEY_A}  team-a  1
{KEY_B}  team-b  1   max_in_flight=2 tokens_per_minute=900  # a comment
sk-team-b-second-key-01 team-b 1 max_in_flight=2 tokens_per_minute=900
{KEY_C}  team-c  2
{KEY_GW} *
"""


def keys_file(tmp_path, text: str):
    path = tmp_path / "keys"
    path.write_text(text)
    return path


def test_a_keys_file_names_tenants_weights_and_caps(tmp_path):
    keys = TenantKeys.load(keys_file(tmp_path, GOOD))
    assert keys.tenant(KEY_A, None) == Tenant("team-a", 1.0)
    assert keys.tenant(KEY_B, None) == Tenant("team-b", 1.0, max_in_flight=2, tokens_per_minute=900)
    assert keys.tenant(KEY_B, None).parameters()["preble_tenant_tokens_per_minute"] == "900"
    assert keys.tenant("sk-team-b-second-key-01", None).name == "team-b"
    assert keys.tenant(KEY_C, None).parameters() == {"preble_tenant": "team-c", "preble_tenant_weight": "2"}
    assert keys.tenant("sk-not-in-the-file-0", None) is None and keys.tenant(None, None) is None
    assert keys.holds(KEY_GW) and not keys.holds("sk-team-a-012345678")  # a prefix is no key


@pytest.mark.parametrize(
    "line, problem",
    [
        ("sk-only-a-key-0000000", "expected <key> <tenant>"),
        ("short team-a", "16 to 256 printable characters"),
        ("sk-0123456789abcdef -team", "must be a tenant name"),
        ("sk-0123456789abcdef team/a", "must be a tenant name"),
        ("sk-0123456789abcdef " + "t" * 65, "must be a tenant name"),
        ("sk-0123456789abcdef team-x 0", "in (0, 1e6]"),
        ("sk-0123456789abcdef team-x -1", "in (0, 1e6]"),
        ("sk-0123456789abcdef team-x nan", "in (0, 1e6]"),
        ("sk-0123456789abcdef team-x inf", "in (0, 1e6]"),
        ("sk-0123456789abcdef team-x heavy", "in (0, 1e6]"),
        ("sk-0123456789abcdef team-x 1 max_in_flight=0", "at least 1"),
        ("sk-0123456789abcdef team-x 1 max_in_flight=lots", "at least 1"),
        ("sk-0123456789abcdef team-x 1 tokens_per_minute=1.5", "at least 1"),
        ("sk-0123456789abcdef team-x 1 admin=yes", "unknown option"),
        ("sk-0123456789abcdef * 2", "a gateway's line"),
        (f"{KEY_A} team-z", "already on another line"),
        ("sk-0123456789abcdef team-c 1", "weight 1 here but weight 2 on line 5"),
        ("sk-0123456789abcdef team-b 1 max_in_flight=3", "max_in_flight=3 here but weight 1 max_in_flight=2"),
    ],
)
def test_a_bad_line_refuses_the_file_naming_the_line(tmp_path, line, problem):
    with pytest.raises(KeysFileError) as refused:
        TenantKeys.load(keys_file(tmp_path, GOOD + line + "\n"))
    assert f"line {GOOD.count(chr(10)) + 1}: " in str(refused.value) and problem in str(refused.value)


def test_an_empty_or_unreadable_keys_file_is_refused(tmp_path):
    with pytest.raises(KeysFileError, match="no keys"):
        TenantKeys.load(keys_file(tmp_path, "# nothing\n\n"))
    with pytest.raises(KeysFileError, match="cannot be read"):
        TenantKeys.load(tmp_path / "absent")
    with pytest.raises(KeysFileError, match="cannot be read"):
        TenantKeys.load(keys_file(tmp_path, "x").parent)  # a directory


def test_only_a_gateways_key_names_a_tenant_by_header(tmp_path):
    gate = TenantGate(TenantKeys.load(keys_file(tmp_path, GOOD)))
    with pytest.raises(TenantRefused) as refused:
        gate.tenant(KEY_A, "team-c")  # team-a asking to be served from team-c's share
    assert refused.value.status == 403 and "only a gateway's key names tenants" in str(refused.value)
    assert gate.tenant(KEY_GW, "team-c") == Tenant("team-c", 2.0)  # its weight is the file's
    assert gate.tenant(KEY_GW, "walk-in") == Tenant("walk-in", 1.0)
    assert gate.tenant(KEY_GW, None).name == DEFAULT_TENANT
    for bad in ("", "a b", "x" * 65, "../etc", GATEWAY):
        with pytest.raises(TenantRefused) as refused:
            gate.tenant(KEY_GW, bad)
        assert refused.value.status == 400
    no_file = TenantGate()
    assert no_file.tenant(None, None).name == DEFAULT_TENANT
    with pytest.raises(TenantRefused, match="names no tenants"):
        no_file.tenant("any", "team-a")


def test_a_tenant_over_its_cap_is_refused_with_429_and_its_slots_come_back(tmp_path):
    gate = TenantGate(TenantKeys.load(keys_file(tmp_path, GOOD)))
    b, a = gate.tenant(KEY_B, None), gate.tenant(KEY_A, None)
    gate.admit(b)
    gate.admit(b)
    with pytest.raises(TenantRefused) as refused:
        gate.admit(b)
    assert refused.value.status == 429 and "max_in_flight=2" in str(refused.value)
    for _ in range(10):
        gate.admit(a)  # no cap: others are not held back
    gate.release(b)
    gate.admit(b)
    assert gate.in_flight == {"team-b": 2, "team-a": 10}
    for _ in range(10):
        gate.release(a)
    assert gate.in_flight == {"team-b": 2}


def test_the_router_reads_the_tenant_and_never_samples_with_it():
    inputs = {"text_input": np.array([b"Hello"], dtype=np.object_)}
    params = {"max_tokens": 3, "preble_tenant": "team-a", "preble_tenant_weight": "2"}
    req = parse_generate(inputs, json.dumps(params))
    assert (
        req.tenant == {"preble_tenant": "team-a", "preble_tenant_weight": "2"} and req.tenant_name == "team-a"
    )
    assert json.loads(req.params_json) == {"max_tokens": 3} and req.params.max_tokens == 3
    assert parse_generate(inputs, "{}").tenant_name == DEFAULT_TENANT
    for bad, problem in [({"preble_tenant": "a b"}, "tenant name"), ({"preble_tenant": 7}, "tenant name"),
                         ({"preble_tenant": "a", "preble_tenant_weight": "0"}, "in (0, 1e6]"),
                         ({"preble_tenant_weight": "2"}, "name no tenant"),
                         ({"preble_tenant": "a", "preble_tenant_tokens_per_minute": "0"}, "at least 1"),
                         ({"preble_tenant": "a", "preble_tenant_tokens_per_minute": "-5"}, "at least 1"),
                         ]:  # fmt: skip
        with pytest.raises(BadRequest, match=problem.replace("(", r"\(").replace("]", r"\]")):
            parse_generate(inputs, json.dumps(bad))


def test_an_engine_reads_the_tenant_from_the_request_parameters():
    inputs = {"input_ids": np.array([1, 2, 3], dtype=np.int32)}
    call = parse_engine_call(
        inputs, "r1", json.dumps({"preble_tenant": "team-c", "preble_tenant_weight": "2"})
    )
    assert (call.tenant, call.tenant_weight) == ("team-c", 2.0)
    assert parse_engine_call(inputs, "r2", None).tenant == DEFAULT_TENANT
    with pytest.raises(BadRequest, match="tenant name"):
        parse_engine_call(inputs, "r3", json.dumps({"preble_tenant": ""}))


def test_an_engine_charges_each_tenant_and_reports_its_counts_as_its_own_source(tiny_model):
    engine = Engine(EngineConfig(model_path=tiny_model, max_num_tokens=2048))
    ledger = TenantLedger(engine, "preble_engine_0")
    prompt = list(range(5, 45))
    engine.add_request("a", prompt, {"max_tokens": 4, "ignore_eos": True}, tenant=("team-a", None))
    engine.add_request("c", prompt, {"max_tokens": 4, "ignore_eos": True}, tenant=("team-c", 2.0))
    while engine.has_work():
        engine.step()
    report = ledger.report()["tenants"]
    assert ledger.source.startswith("preble_engine_0@") and report["weights"] == {"team-c": 2.0}
    service = {t: by_source[ledger.source] for t, by_source in report["service"].items()}
    assert engine.stats()["prompt_tokens_computed"] == 80  # admitted together: neither found the other's
    # 1 per prompt token computed, 2 per output token a decode pass computed (the first of
    # the 4 comes out of the prompt's own pass)
    assert service == {"team-a": 40 + 2 * 3, "team-c": 40 + 2 * 3}
    assert report["waiting"] == {}


class Recorder:
    def __init__(self) -> None:
        self.values: dict[tuple, float] = {}

    def count(self, name, delta, labels=None):
        key = (name, json.dumps(labels, sort_keys=True))
        self.values[key] = self.values.get(key, 0) + delta

    def gauge(self, name, value, labels=None):
        self.values[(name, json.dumps(labels, sort_keys=True))] = value


def test_counts_reach_every_engine_through_either_router_and_survive_a_router_restart():
    engines = [TenantShares(), TenantShares()]  # two engines' copies; each charges as its own source
    engines[0].charge("team-a", "e0", computed=900)
    engines[1].charge("team-b", "e1", computed=300)
    one, two = ClusterShares(), ClusterShares()

    def probe(router: ClusterShares, i: int, now: float) -> None:
        engines[i].merge(router.probe_fields()["shares"])  # the probe carries the router's copy in
        report = {"service": engines[i].snapshot(), "waiting": {"team-a": 1, "team-b": 1}, "weights": {}}
        router.learn(i, {"tenants": report}, now)  # and its answer the engine's out

    probe(one, 0, 0.0)  # router one sees engine 0 only, router two engine 1 only: a partition
    probe(two, 1, 0.0)
    assert engines[1].service("team-a") == 0 and engines[0].service("team-b") == 0
    probe(two, 0, 1.0)  # healed: router two carries engine 1's counts to engine 0, and back
    probe(two, 1, 2.0)
    assert [e.service("team-a") for e in engines] == [900, 900]
    assert [e.service("team-b") for e in engines] == [300, 300]
    restarted = ClusterShares()  # a router that restarts learns the counts back in one probe
    probe(restarted, 1, 3.0)
    assert restarted.shares.service("team-a") == 900 and restarted.shares.service("team-b") == 300


def test_the_fairness_index_is_jains_over_the_backlogged_tenants_service_in_the_window():
    router = ClusterShares(window_s=60)
    copy = TenantShares()

    def report(now: float, waiting: dict[str, int]) -> None:
        router.learn(0, {"tenants": {"service": copy.snapshot(), "waiting": waiting,
                                     "weights": {"team-c": 2.0}}}, now)  # fmt: skip

    copy.charge("team-a", "e0", computed=5000)  # served before the window: it does not count
    report(0.0, {"team-a": 3, "team-c": 3})
    copy.charge("team-a", "e0", computed=100)
    copy.charge("team-c", "e0", computed=200)
    copy.charge("team-idle", "e0", computed=50)  # not backlogged: left out
    report(30.0, {"team-a": 3, "team-c": 3})
    assert router.fairness_index() == pytest.approx(1.0)  # 100/1 and 200/2: shares as weighted
    copy.charge("team-a", "e0", computed=300)
    report(90.0, {"team-a": 3, "team-c": 3})  # the window now starts at 30 s
    assert router.fairness_index() == pytest.approx(jain_index([300, 0]))
    router.metrics = recorder = Recorder()
    router.opened("team-a", 1.0)
    assert recorder.values[("preble_router_tenant_in_flight", '{"tenant": "team-a"}')] == 1
    router.closed("team-a")
    assert recorder.values[("preble_router_tenant_in_flight", '{"tenant": "team-a"}')] == 0
    router.publish(recorder)
    assert recorder.values[("preble_tenant_fairness_index", "null")] == pytest.approx(0.5)


def test_a_peers_report_that_is_not_a_count_is_never_merged():
    shares = TenantShares()
    shares.merge({"a": {"e0": 5, "e1": "9", "e2": True, "e3": float("nan"), 4: 1}, "b": [1], 3: {}})
    shares.merge("not a dict")
    assert shares.snapshot() == {"a": {"e0": 5.0}}


def test_a_freed_forwarding_slot_goes_to_the_least_served_tenant_waiting_fifo_within_one():
    async def run() -> list[str]:
        shares = TenantShares(weights={"team-c": 2.0})
        shares.charge("team-a", "e0", computed=1000)  # 1000 per unit of weight
        shares.charge("team-c", "e0", computed=1000)  # 500 per unit of weight
        flights = Flights(max_inflight=1, max_queue=10, shares=shares)
        holder = flights.admit(object(), "team-a")
        assert await holder.wait_for_slot()
        served: list[str] = []

        async def ask(tenant: str, label: str) -> None:
            flight = flights.admit(object(), tenant)
            try:
                assert await flight.wait_for_slot()
                served.append(label)
            finally:
                flight.close()  # as the router settles every flight, cancelled or not

        labels = [("team-a", "a1"), ("team-a", "a2"), ("team-c", "c1"), ("team-b", "b1")]
        tasks = [asyncio.create_task(ask(tenant, label)) for tenant, label in labels]
        gone = asyncio.create_task(ask("team-b", "cancelled"))
        await asyncio.sleep(0)
        gone.cancel()  # a waiter that left gives up its turn, holding no slot
        await asyncio.sleep(0)
        holder.close()
        await asyncio.gather(*tasks)
        assert flights.counts() == (0, 0) and flights._free == 1  # every slot back
        return served

    # team-b, new, is lifted to the least waiting (team-c's 500) and wins the tie, having had nothing
    assert asyncio.run(run()) == ["b1", "c1", "a1", "a2"]


def test_a_tenants_tokens_per_minute_refuses_it_until_its_bucket_refills():
    now = [0.0]
    budgets = TokenBudgets(clock=lambda: now[0])
    budgets.admit("team-a", 600, 500)  # a minute's 600 tokens, 10 a second: 100 left
    budgets.admit("team-a", 600, 200)  # admitted while any is left: -100 now
    budgets.admit("team-b", 0, 10**9)  # no cap
    with pytest.raises(RateLimited) as refused:
        budgets.admit("team-a", 600, 1)
    assert "tokens_per_minute=600" in str(refused.value) and retry_after(str(refused.value)) == "11"
    assert rate_limited(str(refused.value)) and not retryable(str(refused.value))
    now[0] = 11.0  # 110 tokens back: 10 left
    budgets.admit("team-a", 600, 1)
    budgets.take("team-a", 600, 50)  # its output tokens, once it ended: -41
    with pytest.raises(RateLimited):
        budgets.admit("team-a", 600, 1)
    now[0] = 1000.0  # a bucket never holds more than a minute's tokens
    budgets.admit("team-a", 600, 600)
    with pytest.raises(RateLimited):
        budgets.admit("team-a", 600, 1)


def test_two_routers_share_one_tokens_per_minute_through_the_engines():
    """Two routers' buckets for one cap of 600 a minute, their counts carried by an engine's
    ledger as the health probes carry them. The first copy a router hears is where counting
    starts; then what one router takes comes out of the other's bucket, so the tenant has
    its 600 through both together. A router that has no bucket for the tenant yet keeps
    what the others spent in the last minute and starts its bucket with that taken out."""
    now = [0.0]
    one, two, late = (TokenBudgets(clock=lambda: now[0], source=name) for name in ("r1", "r2", "r3"))
    engine = TenantLedger.__new__(TenantLedger)
    engine.shares, engine.spent = None, TenantShares()

    def probe(router: TokenBudgets) -> None:
        engine.take(None, router.probe_fields().get("spent"))
        router.learn(engine.report().get("tokens_spent", {}))

    for router in (one, two, late):
        probe(router)  # nothing spent yet: each starts counting
    one.admit("team-a", 600, 400)
    one.take("team-a", 600, 100)  # 500 through router one
    probe(one)
    probe(two)  # router two hears of it: 100 left
    two.admit("team-a", 600, 150)  # admitted while any is left: -50 now
    with pytest.raises(RateLimited) as refused:
        two.admit("team-a", 600, 1)
    assert retry_after(str(refused.value)) == "6"  # 51 tokens at 10 a second
    probe(two)
    probe(one)
    with pytest.raises(RateLimited):
        one.admit("team-a", 600, 1)  # router one heard of router two's 150 too
    probe(late)
    with pytest.raises(RateLimited):
        late.admit("team-a", 600, 1)  # its first bucket starts with the others' 650 taken out
    now[0] = 6.0
    late.admit("team-a", 600, 1)
    assert one.spent.service("team-a") == 650 and two.spent.service("team-a") == 650
    for at in (6.0, 20.0):  # team-c spends 500 through router one twice; router two hears of it
        now[0] = at
        one.admit("team-c", 600, 500)
        probe(one)
        probe(two)
    now[0] = 70.0  # router two's first team-c bucket: the spending at 6 s is over a minute old
    two.admit("team-c", 600, 600)  # 600: the 500 at 20 s has refilled by 500 since
    with pytest.raises(RateLimited) as refused:
        two.admit("team-c", 600, 1)
    assert retry_after(str(refused.value)) == "1"
    one.admit("team-b", 0, 10**6)  # no cap: nothing counted, nothing carried
    assert "team-b" not in one.spent.counts
