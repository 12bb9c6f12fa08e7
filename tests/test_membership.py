"""Engines that join and leave while the router serves: every policy grows and shrinks its
instance set (decisions computed by hand before and after), and discovery reads the
static list, a DNS name and a watched file."""

from __future__ import annotations

import socket
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
from server_utils import (
    assert_engine_pages_free,
    client_for,
    launch,
    metric_value,
    wait_for,
    write_test_repository,
)
from test_e2 import e2, req, stored

from preble_backend.router.engines.discovery import Discovery, dns_entries, split_entries
from scheduler.policies import ALL_POLICIES, make_policy
from scheduler.policy import InstanceLoad


def select(policy, tokens, in_flight=None):
    loads = [InstanceLoad(in_flight=(in_flight or {}).get(i, 0)) for i in range(policy.num_instances)]
    r = req(tokens)
    return r, policy.select(r, loads)


def test_e2_grows_from_no_engine_and_forgets_one_that_left():
    """Serial load model, PREFILLTIME(n) = n ms, DECODETIME = 32 ms per request."""
    policy, _ = e2(n=0)
    assert policy.add_instance() == 0 and policy.live == set()  # not live before its probe answers
    policy.instance_up(0)
    r1, d = select(policy, range(100))
    assert (d.instance, d.branch) == (0, "explore")  # the only instance
    policy.on_finish(0, r1, stored(range(100)))
    assert policy.add_instance() == 1
    policy.instance_up(1)
    r2, d = select(policy, [*range(90), *[7] * 10])
    assert (d.instance, d.branch) == (0, "exploit")  # 90 cached on 0 > 10 missed
    _, d = select(policy, range(200, 300))
    # explore: L0 = r2's 10 missed + 32 = 42, L1 = 0; P = 100 on both; M = 0
    assert (d.instance, d.branch) == (1, "explore")
    policy.withdraw(0)  # leaving: nothing new, though it still caches range(100)
    r4, d = select(policy, [*range(90), *[8] * 10])
    assert (d.instance, d.branch) == (1, "explore")  # the key's only holder takes no requests
    policy.on_finish(0, r2, stored([*range(90), *[7] * 10]))  # its last request's report still counts
    assert policy.cached_tokens(0) == 110
    policy.instance_down(0)  # drained: forgotten
    assert policy.tree.cached_sequences(0) == set() and policy.cached_tokens(0) == 0
    assert policy.add_instance() == 2  # a new slot: 0 is never handed to another engine
    policy.instance_up(2)
    _, d = select(policy, [*range(90), *[9] * 10])
    # 90 of the prefix are on 1's path (r4 in flight there) > 10 missed: exploit picks 1, the
    # most loaded (r3, r4: 2 x (100 + 32)), more than th_bal x the newcomer's 0, and the gap
    # 264 exceeds the 90 ms that moving recomputes: rebalanced to 2
    assert (d.instance, d.branch) == (2, "rebalance")


def test_cache_aware_grows_a_tree_for_the_newcomer():
    policy = make_policy("cache_aware", 1, {"page_size": 1})
    select(policy, range(100))
    assert policy.add_instance() == 1
    policy.instance_up(1)
    _, d = select(policy, [*range(90), *[7] * 10], {0: 1})
    assert (d.instance, d.branch) == (0, "cache_hit")  # 90/100 matched > 0.3 on 0's tree
    _, d = select(policy, range(500, 600), {0: 2})
    assert (d.instance, d.branch) == (1, "cache_miss")  # nothing matched: the least loaded
    _, d = select(policy, range(500, 600), {0: 2, 1: 1})
    assert (d.instance, d.branch) == (1, "cache_hit")  # the newcomer's own tree now holds it


def test_prefix_hash_ring_grows_as_if_built_with_the_newcomer():
    grown, built = make_policy("prefix_hash", 3), make_policy("prefix_hash", 4)
    keys = [list(range(k, k + 600)) for k in range(400)]
    before = [select(grown, key)[1].instance for key in keys]
    assert grown.add_instance() == 3
    grown.instance_up(3)
    after = [select(grown, key)[1].instance for key in keys]
    assert after == [select(built, key)[1].instance for key in keys]
    moved = [a for b, a in zip(before, after) if a != b]
    assert set(moved) == {3}  # consistent hashing: keys move only to the newcomer, ~1/4 of them
    assert 0.15 < len(moved) / len(keys) < 0.35


def test_kv_cost_counts_the_newcomer_s_active_blocks():
    policy = make_policy("kv_cost", 1, {"page_size": 16})
    select(policy, range(64))  # 4 blocks active on 0
    assert policy.add_instance() == 1
    policy.instance_up(1)
    _, d = select(policy, range(100, 132))  # cost 2 + 4 on 0, 2 + 0 on 1
    assert d.instance == 1 and policy.active_blocks == [4, 2]


@pytest.mark.parametrize("name", ALL_POLICIES)
def test_every_policy_routes_to_a_joined_instance_and_not_to_a_withdrawn_one(name):
    policy = make_policy(name, 1, {"page_size": 1})
    assert policy.add_instance() == 1
    chosen = {select(policy, range(i, i + 40))[1].instance for i in range(20)}
    assert chosen == {0}  # joined but not yet up
    policy.instance_up(1)
    chosen = {select(policy, range(i * 50, i * 50 + 40), {0: 3})[1].instance for i in range(40)}
    assert 1 in chosen
    policy.withdraw(0)
    assert {select(policy, range(i, i + 40))[1].instance for i in range(20)} == {1}


def test_discovery_joins_the_static_list_the_file_and_dns(tmp_path):
    listed = tmp_path / "engines"
    listed.write_text(
        "# engines of host b\nb0=grpc://10.0.1.2:8001/e\n\nb1=grpc://10.0.1.3:8001/e, preble_engine_1\n"
    )
    answers = {"svc.local": ["10.0.2.5", "10.0.2.4", "10.0.2.5"]}

    def resolve(host, port, type):
        if host not in answers:
            raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")
        if answers[host] is None:
            raise socket.gaierror(socket.EAI_AGAIN, "Temporary failure in name resolution")
        return [(socket.AF_INET, type, 6, "", (ip, port)) for ip in answers[host]]

    warnings = []
    found = Discovery("preble_engine_0", "svc.local:8001/preble_engine_0", str(listed), 60, warnings.append,
                      resolve)  # fmt: skip
    assert found.current == [
        "preble_engine_0",
        "10.0.2.4:8001=grpc://10.0.2.4:8001/preble_engine_0",
        "10.0.2.5:8001=grpc://10.0.2.5:8001/preble_engine_0",
        "b0=grpc://10.0.1.2:8001/e",
        "b1=grpc://10.0.1.3:8001/e",
        "preble_engine_1",
    ]
    answers["svc.local"] = None  # a lost DNS reply keeps the last answer, with one warning
    assert found.read() == found.current and found.read() == found.current
    assert len(warnings) == 1 and "did not resolve" in warnings[0]
    del answers["svc.local"]  # the name has no addresses: no engines from it
    listed.unlink()  # a file not written yet: none from it
    assert found.read() == ["preble_engine_0"]
    listed.write_text("grpc://nowhere/e")  # an entry that cannot be parsed: the file's last answer
    assert found.read() == ["preble_engine_0"] and "could not be read" in warnings[-1]
    assert dns_entries("h:1/m", lambda *a, **k: [(0, 0, 0, "", ("fd00::7", 1, 0, 0))]) == [
        "[fd00::7]:1=grpc://[fd00::7]:1/m"
    ]
    for bad in ("svc.local/m", "svc.local:x/m", "svc.local:8001"):
        with pytest.raises(ValueError, match="expected host:port/model"):
            Discovery("", bad)
    assert split_entries("a, b\n# c\nd # e") == ["a", "b", "d"]


def test_discovery_polls_and_reports_joins_and_leaves(tmp_path):
    listed = tmp_path / "engines"
    listed.write_text("a=grpc://10.0.0.1:1/e\n")
    found, changes, seen = Discovery("", file=str(listed), interval_s=0.05), [], threading.Event()
    found.start(lambda joined, left: (changes.append((joined, left)), seen.set()))
    try:
        listed.write_text("b=grpc://10.0.0.2:1/e\n")
        assert seen.wait(5)
        assert changes == [(["b=grpc://10.0.0.2:1/e"], ["a=grpc://10.0.0.1:1/e"])]
    finally:
        found.stop()


@pytest.mark.server
def test_a_router_follows_its_engines_file(tmp_path):
    """Engines named in a watched file join (probed, then routed to), and one that leaves
    finishes the request it runs, takes no more, and is forgotten: the router's belief of
    each engine's cache is the engine's own count after every change."""
    listed = tmp_path / "engines"
    listed.write_text("preble_engine_0\n")
    router = {"engines": "", "engines_file": str(listed), "discovery_interval_s": 0.2}
    srv = launch(write_test_repository(tmp_path / "repo", router_overrides=router), tmp_path / "server.log")
    try:
        client, metrics = client_for(srv), f"http://127.0.0.1:{srv.ports.metrics}"

        def ask(i: int, max_tokens: int = 8, **where) -> dict:
            params = {"temperature": 0, "max_tokens": max_tokens, "ignore_eos": True}
            return client.generate(f"request {i}: " + "shared words " * 20, params,
                                   exclude_input_in_output=True, **where)  # fmt: skip

        def exact(engine: str) -> bool:  # the router's belief is the engine's own count
            believed = metric_value(metrics, "preble_router_cached_pages", f'engine="{engine}"')
            return believed == metric_value(metrics, "preble_engine_kv_pages_cached", f'model="{engine}"')

        assert {ask(i)["instance"] for i in range(4)} == {"preble_engine_0"}
        wait_for(lambda: exact("preble_engine_0"), 30, "the tree is exact for engine 0")
        listed.write_text("preble_engine_0\npreble_engine_1  # joins\n")
        up = lambda engine: metric_value(metrics, "preble_router_engine_up", f'engine="{engine}"')  # noqa: E731
        wait_for(lambda: up("preble_engine_1") == 1, 30, "engine 1 up")
        assert {ask(i)["instance"] for i in range(4, 10)} == {"preble_engine_0", "preble_engine_1"}
        both = lambda: exact("preble_engine_0") and exact("preble_engine_1")  # noqa: E731
        wait_for(both, 30, "the tree is exact for both")
        with ThreadPoolExecutor(1) as pool:  # engine 0 leaves while it runs a long request
            running = pool.submit(ask, 99, 600, preble_engine="preble_engine_0")
            running_there = lambda: client.engine_control("preble_engine_0", "stats")["load"]["running"]  # noqa: E731
            wait_for(running_there, 30, "a request running on engine 0")
            listed.write_text("preble_engine_1\n")
            wait_for(lambda: metric_value(metrics, "preble_router_engines") == 1, 30, "engine 0 left")
            assert {ask(i)["instance"] for i in range(10, 16)} == {"preble_engine_1"}
            answer = running.result(timeout=120)
        assert answer["instance"] == "preble_engine_0"  # drained: it finished where it ran
        assert answer["text_output"] == ask(99, 600)["text_output"]
        believed = lambda: metric_value(metrics, "preble_router_cached_pages", 'engine="preble_engine_0"')  # noqa: E731
        wait_for(lambda: believed() == 0, 30, "engine 0 forgotten")
        assert up("preble_engine_0") == 0
        wait_for(lambda: exact("preble_engine_1"), 30, "the tree is exact for engine 1")
        for engine in ("preble_engine_0", "preble_engine_1"):
            assert_engine_pages_free(client, engine)
    finally:
        srv.stop()
