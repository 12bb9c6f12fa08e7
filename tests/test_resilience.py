"""The router under production traffic: bursts of simultaneous clients, clients that vanish
mid-stream, a router at capacity, an engine stub killed under load, a remote engine's
server killed and restarted. Every request finishes or gets an error naming the cause;
nothing hangs; every KV page comes back."""

from __future__ import annotations

import os
import signal
import threading
import time
import urllib.request
from pathlib import Path

import pytest
from server_utils import (
    assert_engine_pages_free,
    client_for,
    kill_stub_between_sends,
    launch,
    write_test_repository,
)

from client.stress import BurstConfig, run_burst
from client.triton_client import PrebleError
from preble_backend.common.procfs import command_line, group_running, process_alive, process_tree
from preble_backend.runtime.launcher import ServerPorts, start_server

pytestmark = pytest.mark.server
ENGINES = ("preble_engine_0", "preble_engine_1")
SHARED = " ".join(f"tool_{i}(query, limit)" for i in range(80))  # a long prefix to exploit


def _burst(server, **kw) -> BurstConfig:
    return BurstConfig(f"127.0.0.1:{server.ports.http}", f"127.0.0.1:{server.ports.grpc}", **kw)


def _metric(server, line_start: str) -> float:
    with urllib.request.urlopen(f"http://127.0.0.1:{server.ports.metrics}/metrics", timeout=10) as r:
        lines = [ln for ln in r.read().decode().splitlines() if ln.startswith(line_start)]
    return sum(float(ln.rsplit(" ", 1)[1]) for ln in lines)


def _rss_mib(pid: int) -> float:
    status = Path(f"/proc/{pid}/status").read_text()
    return int(next(ln for ln in status.splitlines() if ln.startswith("VmRSS")).split()[1]) / 1024


def _wait_running(client, engine: str) -> None:
    """Until the engine runs a request (30 s at most)."""
    deadline = time.monotonic() + 30
    while client.engine_control(engine, "stats")["load"]["running"] == 0 and time.monotonic() < deadline:
        time.sleep(0.05)


def _router_stub(server) -> int:
    for pid in process_tree(server.process.pid):
        if b"/preble/1/model.py" in b" ".join(command_line(pid)):
            return pid
    raise AssertionError("no router stub")


@pytest.fixture(scope="module")
def server(tmp_path_factory, tiny_model):
    root = tmp_path_factory.mktemp("burst")
    srv = launch(write_test_repository(root / "repo"), root / "server.log")
    yield srv
    srv.stop()


def test_bursts_of_200_mixed_clients_all_finish_and_every_page_comes_back(server):
    cfg = _burst(server, requests=200, max_tokens=64, prefix_words=300)
    router, threads, done = _router_stub(server), [], threading.Event()

    def count_threads() -> None:  # the router's threads while 200 requests are in flight
        while not done.wait(0.02):
            threads.append(len(os.listdir(f"/proc/{router}/task")))

    sampler = threading.Thread(target=count_threads)
    sampler.start()
    try:
        for _ in range(3):
            report, outcomes = run_burst(cfg)
            assert report.completed == 200, report.errors
            assert report.by_kind == {"sse": 67, "generate": 67, "grpc": 66}
            assert {o.finish_reason for o in outcomes} == {"length"}
    finally:
        done.set()
        sampler.join()
    assert server.process.poll() is None
    # One event loop carries every stream: no thread per request (that router held 200+).
    assert max(threads) < 64, max(threads)
    client = client_for(server)
    for engine in ENGINES:
        assert_engine_pages_free(client, engine)


def test_clients_that_vanish_mid_stream_leave_the_server_serving(server):
    client = client_for(server)
    params = {"max_tokens": 2000, "ignore_eos": True}
    outcomes: list[object] = []

    def vanish_grpc(i: int) -> None:
        outcomes.append(len(client.stream_grpc(f"{SHARED} grpc {i}", params, cancel_after=2).responses))

    def vanish_sse(i: int) -> None:
        events = client.generate_stream(f"{SHARED} sse {i}", params)
        outcomes.append(next(events))
        events.close()  # the connection closes mid-stream

    threads = [threading.Thread(target=f, args=(i,)) for i in range(20) for f in (vanish_grpc, vanish_sse)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert len(outcomes) == 40
    report, _ = run_burst(_burst(server, requests=30, max_tokens=16, prefix_words=100))
    assert report.completed == 30, report.errors
    for engine in ENGINES:
        assert_engine_pages_free(client, engine)


# ---- a small router: admission, and an engine killed under load ------------------------------


@pytest.fixture(scope="module")
def small(tmp_path_factory, tiny_model):
    root = tmp_path_factory.mktemp("small")
    overrides = {"max_inflight": 4, "max_queue": 4, "health_interval_s": 0.2, "migration_limit": 0}
    repo = write_test_repository(root / "repo", router_overrides=overrides)
    srv = launch(repo, root / "server.log")
    yield srv
    srv.stop()


def test_beyond_max_inflight_and_max_queue_requests_are_refused_at_once(small):
    rss = []
    for _ in range(3):  # sustained overload: memory stays flat
        report, outcomes = run_burst(_burst(small, requests=60, max_tokens=32, prefix_words=50))
        refused = [o for o in outcomes if o.error and "at capacity" in o.error]
        assert report.completed + len(refused) == 60, report.errors
        assert report.completed >= 8 and len(refused) >= 20
        assert max(o.latency_s for o in refused) < 2  # at once, not after queueing
        rss.append(_rss_mib(_router_stub(small)))
    assert rss[-1] - rss[0] < 20, rss
    assert _metric(small, "preble_router_rejected_total") >= 60


def test_without_migration_a_killed_engine_fails_its_requests_fast_and_is_routed_around(small):
    client = client_for(small)
    first = client.generate(SHARED, {"max_tokens": 2})["instance"]
    assert client.generate(f"{SHARED} again", {"max_tokens": 2})["instance"] == first  # exploited
    other = next(e for e in ENGINES if e != first)
    pid = client.engine_control(first, "health")["load"]["pid"]
    results: dict[int, object] = {}

    def stream(i: int) -> None:
        start = time.monotonic()
        try:
            result = client.stream_grpc(f"{SHARED} q{i}", {"max_tokens": 400, "ignore_eos": True}, timeout=60)
            results[i] = ("ok", result.final["instance"], time.monotonic() - start)
        except PrebleError as exc:
            results[i] = ("error", str(exc), time.monotonic())

    threads = [threading.Thread(target=stream, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    _wait_running(client, first)
    kill_stub_between_sends(pid)
    killed_at = time.monotonic()
    for t in threads:
        t.join(60)
    assert len(results) == 3
    failed = [r for r in results.values() if r[0] == "error"]
    assert failed, results  # the prefix lives on the killed engine: its requests were there
    for _, message, at in failed:
        assert first in message and at - killed_at < 5, (message, at - killed_at)
    assert all(r[1] == other for r in results.values() if r[0] == "ok")
    # The shared prefix was cached only on the dead engine: it goes to the live one now.
    for i in range(6):
        assert client.generate(f"{SHARED} after {i}", {"max_tokens": 4})["instance"] == other
    assert _metric(small, f'preble_router_engine_up{{engine="{first}"') == 0
    assert f"engine {first} is down" in small.log_path.read_text()
    stubs = process_tree(small.process.pid)[1:]
    started = time.monotonic()
    small.stop()
    assert time.monotonic() - started < 15
    assert not [p for p in stubs if process_alive(p)]  # the killed one may linger as a zombie


def test_a_killed_local_engine_s_requests_migrate_with_the_fault_free_text(tmp_path, tiny_model):
    """One server holding the router and both engines (``--layout single``): the engine
    holding the streams dies; each continues on the other from its prompt and the tokens
    already sent, and greedy decoding gives exactly the text of an undisturbed run."""
    repo = write_test_repository(tmp_path / "repo", router_overrides={"health_interval_s": 0.2})
    srv = launch(repo, tmp_path / "server.log")
    try:
        client = client_for(srv)
        params = {"max_tokens": 200, "ignore_eos": True, "temperature": 0}
        first = client.generate(SHARED, {"max_tokens": 2})["instance"]
        other = next(e for e in ENGINES if e != first)
        prompts = [f"{SHARED} q{i}" for i in range(3)]  # exploited: all on ``first``
        reference = {p: client.stream_grpc(p, params).text for p in prompts}
        results: dict[str, object] = {}

        def stream(prompt: str) -> None:
            result = client.stream_grpc(prompt, params, timeout=60)
            results[prompt] = (result.text, result.final["instance"])

        threads = [threading.Thread(target=stream, args=(p,)) for p in prompts]
        for t in threads:
            t.start()
        _wait_running(client, first)
        kill_stub_between_sends(client.engine_control(first, "health")["load"]["pid"])
        for t in threads:
            t.join(60)
        assert results == {p: (text, other) for p, text in reference.items()}
        assert _metric(srv, "preble_router_migrations_total") >= 1
    finally:
        srv.stop()


# ---- a remote engine's server killed and restarted ---------------------------------------


def test_remote_engine_server_killed_then_restarted_rejoins(tmp_path, tiny_model):
    from server_utils import fresh_ports

    ports = fresh_ports()
    engine_repo = write_test_repository(tmp_path / "engine", cpu_engines=1, with_router=False)
    remote = f"grpc://127.0.0.1:{ports.grpc}/preble_engine_0"
    front_repo = write_test_repository(
        tmp_path / "front", cpu_engines=1, remote_engines=[remote],
        router_overrides={"policy": "round_robin", "health_interval_s": 0.2},
    )  # fmt: skip
    engine_server = _start(engine_repo, ports, tmp_path / "engine.log")
    front = launch(front_repo, tmp_path / "front.log")
    try:
        client = client_for(front)
        assert {client.generate(f"warm {i}", {"max_tokens": 2})["instance"] for i in range(2)} == {
            "preble_engine_0",
            remote,
        }
        results: list[tuple] = []

        def stream(i: int) -> None:
            try:
                # ~4 s of tokens here: the kill at 1 s finds every stream mid-way (300 tokens took
                # about 1 s, and a stream that finished first on the doomed engine failed the test)
                r = client.stream_grpc(f"long {i}", {"max_tokens": 1200, "ignore_eos": True}, timeout=60)
                results.append(("ok", r.final["instance"]))
            except PrebleError as exc:
                results.append(("error", str(exc), time.monotonic()))

        threads = [threading.Thread(target=stream, args=(i,)) for i in range(4)]
        for t in threads:
            t.start()
        time.sleep(1.0)
        os.killpg(engine_server.process.pid, signal.SIGKILL)
        killed_at = time.monotonic()
        for t in threads:
            t.join(60)
        # The lost server's streams went on in the other engine (migrated), within seconds.
        assert results == [("ok", "preble_engine_0")] * 4, results
        assert time.monotonic() - killed_at < 30
        for i in range(4):  # routed around the lost server
            assert client.generate(f"meanwhile {i}", {"max_tokens": 2})["instance"] == "preble_engine_0"
        engine_server.stop()
        engine_server = _start(engine_repo, ports, tmp_path / "engine2.log")
        deadline = time.monotonic() + 30
        seen = set()
        while remote not in seen and time.monotonic() < deadline:
            seen.add(client.generate("rejoin?", {"max_tokens": 2})["instance"])
            time.sleep(0.2)
        assert remote in seen
    finally:
        front.stop()
        engine_server.stop()


def _start(repo: Path, ports: ServerPorts, log: Path):
    server = start_server(repo, ports, log_path=log)
    server.wait_ready(300)
    return server


def test_stubs_exit_when_their_server_is_killed_under_load(tmp_path, tiny_model):
    server = launch(write_test_repository(tmp_path / "repo"), tmp_path / "server.log")
    try:
        burst = threading.Thread(target=run_burst, args=(_burst(server, requests=60, max_tokens=64),))
        burst.start()
        _wait_running(client_for(server), ENGINES[0])
        os.kill(server.process.pid, signal.SIGKILL)  # the server alone: its stubs are orphaned
        server.process.wait()
        deadline = time.monotonic() + 10
        while group_running(server.process.pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not group_running(server.process.pid)
        burst.join(60)
    finally:
        server.stop()


def test_a_streaming_answer_is_not_held_up_by_requests_queued_for_their_first_token(tmp_path, tiny_model):
    """The Python backend runs a model instance's BLS calls and its response sends on one
    pool of 32 threads, and a BLS call holds its thread until the engine's first response.
    Forty requests queued behind a streaming one (an engine that runs one request at a
    time) used to take every thread of the router, so the streaming answer's tokens
    stalled until the queue drained. The router now reaches engines over gRPC."""
    import asyncio
    import json

    import tritonclient.grpc.aio as grpcaio

    from client.triton_client import infer_inputs
    from preble_backend.common.cost_model import CostModel

    fit = tmp_path / "slow.json"
    CostModel(base_ms=40, prefill_ms_per_token=0, decode_ms_per_request=0,
              attention_ms_per_context_token=0, decode_step_ms=40).save(fit)  # fmt: skip
    repo = write_test_repository(tmp_path / "repo", cpu_engines=1, compute="emulated", cost_model=str(fit),
                                 max_running_requests=1)  # fmt: skip
    server = launch(repo, tmp_path / "server.log")
    finished: dict[str, float] = {}

    async def stream(client, name: str, prompt: str, max_tokens: int) -> None:
        params = json.dumps({"max_tokens": max_tokens, "ignore_eos": True})
        inputs = infer_inputs({"text_input": prompt, "stream": True, "sampling_parameters": params})

        async def one():
            yield {"model_name": "preble", "inputs": inputs,
                   "parameters": {"triton_enable_empty_final_response": True}}  # fmt: skip

        async for result, error in client.stream_infer(one()):
            assert error is None, error
            if result.get_response().parameters["triton_final_response"].bool_param:
                finished[name] = time.monotonic()

    async def scenario() -> None:
        client = grpcaio.InferenceServerClient(f"127.0.0.1:{server.ports.grpc}")
        try:
            first = asyncio.create_task(stream(client, "streaming", "a long answer", 30))
            await asyncio.sleep(0.3)  # it runs; the rest queue behind it for their first token
            queued = [stream(client, f"q{i}", f"question {i}", 1) for i in range(40)]
            await asyncio.gather(first, *queued)
        finally:
            await client.close()

    try:
        asyncio.run(asyncio.wait_for(scenario(), 120))
        assert len(finished) == 41
        # The engine finishes the streaming answer before it starts any queued request.
        assert finished["streaming"] < min(t for name, t in finished.items() if name != "streaming")
        assert_engine_pages_free(client_for(server), "preble_engine_0")
    finally:
        server.stop()


def test_router_survives_sustained_load_while_it_probes_its_engines(tmp_path, tiny_model):
    """Minutes of production traffic compressed into seconds: bursts of streaming clients
    while the router probes every engine many times a second. In Triton 2.51's Python
    backend the responses of a decoupled BLS call were freed on the stub's own cleanup
    thread without the GIL whenever Python let go of them first (fixed upstream after
    2.51); their numpy arrays then corrupted the router's heap, and its stub died with
    SIGSEGV within seconds of this test."""
    repo = write_test_repository(
        tmp_path / "repo", cpu_engines=4, compute="emulated", cost_model="mistral7b_a6000",
        router_overrides={"health_interval_s": 0.01},
    )  # fmt: skip
    server = launch(repo, tmp_path / "server.log")
    try:
        router = _router_stub(server)
        deadline = time.monotonic() + 30
        rounds = 0
        while time.monotonic() < deadline:
            cfg = _burst(server, requests=120, max_tokens=32, prefix_words=200, seed=rounds, timeout_s=60)
            report, _ = run_burst(cfg)
            assert report.completed == 120, report.errors
            assert process_alive(router), f"the router stub died: {server.failure()}"
            rounds += 1
        assert rounds >= 3
        client = client_for(server)
        for engine in (f"preble_engine_{i}" for i in range(4)):
            assert_engine_pages_free(client, engine)
    finally:
        server.stop()
