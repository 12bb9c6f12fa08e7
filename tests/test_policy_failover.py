"""Every policy routes around a dead instance and forgets what it cached there, so a
request never waits on an engine that is gone and no prefix is credited to it."""

from __future__ import annotations

import pytest
from test_e2 import e2, route, stored

from preble_backend.common.cache_event import CacheEvent
from preble_backend.common.sampling_params import SamplingParams
from scheduler.policies import make_policy
from scheduler.policy import FinishInfo, InstanceLoad, RoutingRequest


def request(i: int, tokens=(1, 2, 3)) -> RoutingRequest:
    return RoutingRequest(str(i), list(tokens), SamplingParams())


@pytest.mark.parametrize("name", ["e2", "round_robin", "least_load", "prefix_hash", "cache_aware", "kv_cost"])
def test_every_policy_routes_only_to_live_instances(name):
    policy = make_policy(name, 3, {"page_size": 1})
    loads = [InstanceLoad() for _ in range(3)]
    policy.instance_down(1)
    chosen = {policy.select(request(i, range(i, i + 40)), loads).instance for i in range(30)}
    assert chosen <= {0, 2} and chosen
    policy.instance_up(1)
    policy.instance_down(0)
    policy.instance_down(2)
    assert {policy.select(request(i, range(i, i + 40)), loads).instance for i in range(10)} == {1}


def test_e2_forgets_a_dead_instance_and_sends_its_prefix_elsewhere():
    policy, _ = e2(n=2)
    r, d = route(policy, range(100))
    policy.on_finish(d.instance, r, stored(range(100)))
    _, again = route(policy, list(range(90)) + [7] * 10)
    assert (again.instance, again.branch) == (d.instance, "exploit")
    policy.instance_down(d.instance)
    assert policy.tree.cached_sequences(d.instance) == set()
    assert policy.tree.cached_tokens[d.instance] == 0
    _, after = route(policy, list(range(90)) + [8] * 10)
    assert after.instance != d.instance


def test_kv_cost_forgets_what_a_dead_instance_cached():
    policy = make_policy("kv_cost", 2, {"page_size": 16})
    r = request(0, range(64))
    policy.select(r, [InstanceLoad(), InstanceLoad()])
    policy.on_finish(0, r, FinishInfo([CacheEvent.of("stored", range(64), 0, 16)]))
    assert policy.tree.cached_sequences(0)
    policy.instance_down(0)
    assert policy.tree.cached_sequences(0) == set()
