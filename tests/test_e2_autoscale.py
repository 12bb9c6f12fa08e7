"""E2's autoscaling, by hand (helpers and cost model from ``test_e2``): a key portion
whose time to first token doubles or that is too hot for its holder gets a replica, and
the replica retires when the prefix cools."""

from __future__ import annotations

import pytest
from test_e2 import AVG_DECODE, e2, route, stored

from preble_backend.common.block_hash import chain_hashes
from preble_backend.common.cache_event import CacheEvent
from scheduler.policy import FinishInfo


def replicated_by_ttft():
    """A 100-token prefix on instance 0 whose time to first token triples (1 s, then 3 s)
    within a 10 s window: instance 1 becomes its replica at the eighth answer, at t = 9."""
    policy, clock = e2(window_s=10.0, autoscale_min_samples=4, th_bal=float("inf"))  # no rebalancing
    prefix = list(range(100))
    r0, _ = route(policy, prefix)  # explore -> 0 (no key portion yet)
    policy.on_finish(0, r0, stored(prefix))
    times = [0.5, 1.0, 1.5, 2.0, 6.0, 7.0, 8.0, 9.0]  # four answers at ttft 1 s, then four at 3 s
    for k, t in enumerate(times):
        clock.t = t
        r, d = route(policy, prefix + [k])
        assert d.instance == 0
        events = [CacheEvent.of("stored", prefix + [k], 0, 1)]
        policy.on_finish(0, r, FinishInfo(events, {}, 1.0 if k < 4 else 3.0, AVG_DECODE))
        assert policy.tree.match(chain_hashes(prefix + [99], 1)).key.replicas == (set() if k < 7 else {1})
    return policy, clock, prefix


@pytest.mark.parametrize("others, retired", [(2, True), (1, True), (0, False)])
def test_a_replica_retires_when_its_prefix_cools(others, retired):
    """At t = 25 every earlier request has left the 10 s window. One request for the prefix
    (to holder 0, where it misses 1 token, not to the replica, which never computed the
    100) and ``others`` unrelated ones: as it finishes, it is 1 of 1 + others requests
    against its one holder's share of 1/2. Cooled when 1 · 2 <= (1 + others) · 1: with one
    other or more. A retired replica draws nothing more: with ten requests in flight on 0
    (L0 = 10 · (1 + 32) = 330), the next request goes to the replica while there is one
    (at most 82 of load and 101 of prefill there) and to the holder once it retired."""
    policy, clock, prefix = replicated_by_ttft()
    clock.t = 25.0
    r, d = route(policy, prefix + [500])
    assert (d.instance, d.branch) == (0, "exploit")
    for k in range(others):
        route(policy, range(7000 + 100 * k, 7050 + 100 * k))
    policy.on_finish(0, r, FinishInfo([CacheEvent.of("stored", prefix + [500], 0, 1)], {}, 1.0, AVG_DECODE))
    key = policy.tree.match(chain_hashes(prefix + [99], 1)).key
    assert key.replicas == (set() if retired else {1})
    for k in range(10):
        policy.history[0].add(f"busy{k}", clock(), 1.0, 1.0, 101)
    _, d = route(policy, prefix + [501])
    assert (d.instance, d.branch) == ((0, "exploit") if retired else (1, "exploit"))


def test_autoscale_replicates_a_key_portion_whose_ttft_doubles():
    policy, clock, prefix = replicated_by_ttft()
    key = policy.tree.match(chain_hashes(prefix + [99], 1)).key
    assert key.replicas == {1}
    # Candidates are now holder 0 and replica 1. Each request in flight on 0 costs it
    # 1 + 32; instance 1 must prefill all 101 tokens: after four, 4 * 33 + 1 > 101.
    for k in range(4):
        _, d = route(policy, prefix + [100 + k])
        assert (d.instance, d.branch) == (0, "exploit")
    _, d = route(policy, prefix + [99])
    assert (d.instance, d.branch) == (1, "exploit")


@pytest.mark.parametrize(
    "exploits, other_len, replicas",
    [
        (15, 200, {1}),  # 16 of 19 requests, and holder 0 carries 627 > 1.5 x the mean 330.75
        (14, 200, set()),  # 15 uses: under hot_min_requests
        (15, 600, set()),  # the others carry 632 each: 627 is no heavier than the mean
    ],
)
def test_autoscale_replicates_a_key_portion_too_hot_for_its_holder(exploits, other_len, replicas):
    """A prefix hot from the start: its TTFT never doubles, but it draws more of the
    window's requests than one instance's share and its holder carries over 1.5x the mean
    load (history loads: the first request 100 + 32, each exploit 1 + 32, each other
    prompt other_len + 32)."""
    policy, _ = e2(n=4, window_s=100.0, th_bal=float("inf"))  # no rebalancing
    prefix = list(range(100))
    r0, d0 = route(policy, prefix, n=4)
    assert d0.instance == 0
    policy.on_finish(0, r0, stored(prefix))
    hot = [route(policy, prefix + [k], n=4) for k in range(exploits)]
    assert {d.instance for _, d in hot} == {0}
    others = [route(policy, range(5000 + 1000 * k, 5000 + 1000 * k + other_len), n=4)[1] for k in range(3)]
    assert sorted(d.instance for d in others) == [1, 2, 3]
    r, _ = hot[0]
    policy.on_finish(0, r, stored(prefix + [0]))  # the check runs as a key request finishes
    key = policy.tree.match(chain_hashes(prefix + [99], 1)).key
    assert key.replicas == replicas
