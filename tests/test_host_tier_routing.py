"""E2 with host tiers: a prefix in an engine's host tier is exploited and priced at its
load-back, what a tiered engine evicts is priced the same way, tier events cross the
wire, and the simulator charges the load-backs it models; every expected number computed
by hand."""

from __future__ import annotations

import pytest
from test_e2 import e2, route

from preble_backend.common.block_hash import chain_hashes
from preble_backend.common.cache_event import CacheEvent, EventBatch
from preble_backend.common.cost_model import CostModel
from preble_backend.serving.protocol import decode_report, encode_report
from scheduler.global_tree import GlobalPrefixTree
from scheduler.policy import FinishInfo, RoundRobin
from scheduler.sim.simulator import SimConfig, SimRequest, metrics, simulate

# ---- E2 with tiers ------------------------------------------------------------------------------

# 1 ms per prefilled token and 0.05 ms per token loaded back; nothing else costs.
TIERED = CostModel(base_ms=0, prefill_ms_per_token=1, decode_ms_per_request=0,
                   attention_ms_per_context_token=0, decode_step_ms=0, load_ms_per_token=0.05)  # fmt: skip
DOC = list(range(3000, 3400))  # a 400-token document


def test_e2_exploits_a_prefix_in_a_host_tier_and_prices_its_load_back():
    """Instance 1's host tier holds the document, instance 0 holds nothing: a request for
    it plus 20 tokens costs 20 + 0.05 x 400 = 40 ms on instance 1 against 420 ms on
    instance 0, and it is an exploit (400 of 420 tokens held somewhere)."""
    policy, _ = e2(cost=TIERED, load_model="batch")
    policy.tree.apply_events(1, [CacheEvent.of("stored", DOC, 0, 1, "host")])
    prompt = DOC + list(range(9000, 9020))
    m = policy.tree.match(chain_hashes(prompt, 1))
    assert m.matched == 0  # the device tree alone sees nothing
    assert policy._host_reach(m, chain_hashes(prompt, 1)) == {1: 400}
    assert policy.load_cost(1, m, 420, 0.0) == pytest.approx(40.0)
    assert policy.load_cost(0, m, 420, 0.0) == pytest.approx(420.0)
    _, d = route(policy, prompt)
    assert (d.instance, d.branch) == (1, "exploit")


def test_e2_prefers_the_device_copy_to_a_host_copy():
    """The document on instance 0's device and in instance 1's host tier: 20 ms against
    40 ms; the host run starts where the device's ends (instance 1 holds the first 100
    tokens on its device, the rest on its host: 20 + 0.05 x 300 = 35 ms)."""
    policy, _ = e2(cost=TIERED, load_model="batch")
    policy.tree.apply_events(0, [CacheEvent.of("stored", DOC, 0, 1)])
    policy.tree.apply_events(1, [CacheEvent.of("stored", DOC[:100], 0, 1),
                                 CacheEvent.of("stored", DOC, 100, 1, "host")])  # fmt: skip
    prompt = DOC + list(range(9000, 9020))
    m = policy.tree.match(chain_hashes(prompt, 1))
    policy._host_reach(m, chain_hashes(prompt, 1))
    assert policy.load_cost(0, m, 420, 0.0) == pytest.approx(20.0)
    assert policy.load_cost(1, m, 420, 0.0) == pytest.approx(35.0)
    _, d = route(policy, prompt)
    assert (d.instance, d.branch) == (0, "exploit")


def test_e2_knows_a_tiered_engine_from_its_first_probe_and_a_failed_request_changes_nothing():
    """The router hands E2 an engine's health answer before routing there: the KV it
    reports replaces the configured capacity, and its host tier makes what the device
    evicts a load-back (the case above) from the first request on. A refused request's
    empty report is no snapshot: it leaves both as they were (it used to untier the engine
    until its next report)."""
    policy, clock = e2(cost=TIERED, capacity=1000)
    policy.learn(0, {"kv_pages_total": 120, "page_size": 1, "kv_host_pages_total": 64})
    policy.learn(1, {"kv_pages_total": 120, "page_size": 1})
    assert policy.tiered == [True, False] and policy.capacity == [120, 120]
    r, d = route(policy, list(range(100)))
    policy.on_finish(d.instance, r, FinishInfo())
    assert policy.tiered == [True, False] and policy.capacity == [120, 120]


def test_the_simulator_hands_the_policy_each_engine_before_the_first_request():
    """As the router's first health probes do: one snapshot per engine, with its device
    pages and its host tier's, before any ``select``."""
    seen: list[tuple] = []

    class Watching(RoundRobin):
        def learn(self, instance: int, load: dict) -> None:
            seen.append((instance, load["kv_pages_total"], load["kv_host_pages_total"]))

        def select(self, request, loads):
            seen.append("select")
            return super().select(request, loads)

    cfg = SimConfig.of(2, capacity_tokens=2048, page_size=16, host_kv_tokens=4096)
    simulate([SimRequest("r0", 0.0, list(range(40)), 2)], lambda clock: Watching(2, clock), cfg, TIERED)
    assert seen == [(0, 128, 256), (1, 128, 256), "select"]


def test_host_tier_events_cross_the_wire_and_a_dead_engine_is_forgotten():
    events = [CacheEvent.of("stored", DOC, 0, 1), CacheEvent.of("stored", DOC + [1, 2], 400, 1, "host")]
    batch, _ = decode_report(encode_report({}, EventBatch("log", 0, 2, events)))
    assert batch.events == events
    tree = GlobalPrefixTree(2, page_size=1)
    tree.apply_events(1, batch.events)
    assert tree.host.pages[1] == set(chain_hashes(DOC + [1, 2], 1)[400:])
    tree.forget(1)
    assert not tree.host.pages[1] and tree.cached_sequences(1) == set()


# ---- the simulator ------------------------------------------------------------------------------


@pytest.mark.parametrize("copy_ahead", [False, True])
def test_a_simulated_host_tier_keeps_what_the_device_cannot_and_charges_its_copies(copy_ahead):
    """Four documents that do not fit one instance's device together (1,200 tokens each
    on 2,048), visited in turn: without a tier every visit recomputes its document; with
    a host tier every revisit loads it back, and the iterations pay the modelled copies,
    the offloads that made room as well as the load-backs; copies made ahead of eviction,
    beside forward passes longer than they are, cost nothing."""
    docs = [list(range(10_000 * (d + 1), 10_000 * (d + 1) + 1200)) for d in range(4)]
    requests = [SimRequest(f"r{i}", i * 5.0, docs[i % 4] + [i, i + 1], 4) for i in range(16)]
    cost = TIERED
    results = {}
    for host in (0, 8192):
        cfg = SimConfig.of(
            1, capacity_tokens=2048, page_size=16, host_kv_tokens=host, host_copy_ahead=copy_ahead
        )
        run = simulate(requests, lambda clock: RoundRobin(1, clock), cfg, cost)
        results[host] = metrics(run)
        if host:
            tier = run.instances[0].cache.host
            assert tier.stats.pages_loaded == 12 * 75  # 12 revisits, each the document's 75 pages
            # Each request needs 76 pages of the 128: the second makes room by moving 23 of
            # the first document's down, the next three 75 each (what is left of the oldest
            # and the tail of the next), the sixth 52 of the fourth's and 23 loaded back,
            # which the host still holds; from then on every page that goes down is a copy.
            # Ahead or in line, the same pages go down.
            assert tier.stats.pages_offloaded + tier.stats.pages_copied_ahead == 23 + 75 + 75 + 75 + 52
            assert (tier.stats.pages_copied_ahead > 0) == copy_ahead
            in_line = tier.stats.pages_offloaded
    assert results[0]["cache_hit_ratio"] == 0.0
    assert results[8192]["cache_hit_ratio"] == pytest.approx(12 * 1200 / (16 * 1202))
    # Alone on the instance, a request computes its 1,202 tokens in 1.202 s; a revisit
    # loads 1,200 back (0.05 ms each: 60 ms) and prefills 2 (decodes cost nothing here);
    # each page offloaded in line costs 0.05 ms per token too, while the copies ahead (at
    # most a chunk's 512 tokens per pass: 25.6 ms) run beside prefill chunks and a
    # load-back, passes of 96 ms or more, and cost nothing.
    assert results[0]["avg_latency_s"] == pytest.approx(1.202)
    offloads_s = in_line * 16 * 0.05 / 1000
    assert results[8192]["avg_latency_s"] == pytest.approx((4 * 1.202 + 12 * 0.062 + offloads_s) / 16)


def test_e2_with_only_host_tier_holders_queued_everywhere_routes_without_replicating():
    """A prompt whose prefix only a host tier holds has no key portion in the device
    tree, so there is nothing to replicate when its holder queues: E2 still routes it
    (by cost) instead of failing."""
    policy, clock = e2(cost=TIERED, load_model="batch", hot_queue=1.0)
    policy.tree.apply_events(1, [CacheEvent.of("stored", DOC, 0, 1, "host")])
    for k in range(10):  # instance 1 is full: a new request would queue behind ~8
        policy.history[1].add(f"busy{k}", clock(), 0.0, 1.0, 5000)
    _, d = route(policy, DOC + list(range(9000, 9020)))
    assert d.branch == "exploit" and d.instance == 1


def test_e2_prices_what_a_tiered_engine_evicts_at_its_load_back_and_its_copy_down():
    """test_e2's eviction case on engines that report a host tier: evicting instance 0's
    100-token node (two users) costs 2 x 0.05 x 100 = 10 ms of load-backs, not 200, and
    0.05 x 100 = 5 ms to copy it down (the engine waits for each offload), and instance 1's
    (one user) 100; with instance 0's tier only, the new request goes there. Once the host
    mirror holds the node's pages (a copy kept since a load-back), moving it down is free."""
    policy, clock = e2(cost=TIERED, capacity=120)
    a, e = list(range(100)), list(range(200, 300))
    done = [route(policy, a), route(policy, e), route(policy, a)]
    device = {"kv_pages_total": 120, "page_size": 1}  # the engines' snapshots: instance 0's has a tier
    for (r, d), tiered in zip(done, (True, False, True)):
        report = {**device, "kv_host_pages_total": 64} if tiered else device
        info = FinishInfo([CacheEvent.of("stored", r.input_ids, 0, 1)], report, 0.1, 1)
        policy.on_finish(d.instance, r, info)
    assert policy.tiered == [True, False]
    m = policy.tree.match(chain_hashes(list(range(400, 450)), 1))
    assert policy.load_cost(0, m, 50, clock()) == pytest.approx(2 * 0.05 * 100 + 0.05 * 100 + 50)
    assert policy.load_cost(1, m, 50, clock()) == pytest.approx(1 * 100 + 50)
    policy.tree.apply_events(0, [CacheEvent.of("stored", a, 0, 1, "host")])
    assert policy.load_cost(0, m, 50, clock()) == pytest.approx(2 * 0.05 * 100 + 50)
    _, d = route(policy, list(range(400, 450)))
    assert (d.instance, d.branch) == (0, "explore")
