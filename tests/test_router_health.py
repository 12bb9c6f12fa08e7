"""Router pieces for surviving failure, without a server: bounded admission and the
single writer of each response sender, the engine monitor's verdicts, engines that
refuse or fail one request (every policy routing around a dead instance:
test_policy_failover)."""

from __future__ import annotations

import asyncio
import os
import subprocess
import threading
import time
import uuid

import pytest

from preble_backend.common.procfs import process_alive
from preble_backend.common.sampling_params import SamplingParams
from preble_backend.router.engines.engine_client import EngineError, LocalEngine, RemoteEngine
from preble_backend.router.engines.engine_monitor import EngineMonitor
from preble_backend.router.requests.flights import Flights
from preble_backend.router.requests.responder import Responder


class Sender:
    def __init__(self) -> None:
        self.sent: list[tuple[object, int]] = []
        self.cancelled, self.asked, self.finished = False, 0, False

    def send(self, response, flags=0) -> None:
        assert not self.finished, "a response after the final one"
        self.sent.append((response, flags))
        self.finished = bool(flags)

    def is_cancelled(self) -> bool:
        assert not self.finished, "is_cancelled on a sender whose final response went"
        self.asked += 1
        return self.cancelled


def test_admission_refuses_past_inflight_plus_queue_and_slots_come_back():
    async def scenario() -> None:
        flights = Flights(max_inflight=2, max_queue=1)
        admitted = [flights.admit(Sender()) for _ in range(3)]
        assert all(admitted) and flights.admit(Sender()) is None
        assert await admitted[0].wait_for_slot() and await admitted[1].wait_for_slot()
        assert flights.counts() == (3, 1)  # the third waits for a slot
        waiter = asyncio.create_task(admitted[2].wait_for_slot())
        await asyncio.sleep(0.01)
        assert not waiter.done()
        assert admitted[0].close()  # its final response is queued: its slot goes on
        assert await asyncio.wait_for(waiter, 5) and flights.counts() == (2, 0)
        assert flights.admit(Sender()) is not None

    asyncio.run(scenario())


def test_a_flight_answers_once_whoever_ends_it():
    """The responder sends what the loop queues, in order, and nothing after a flight's
    final response; it never asks a finished sender whether it was cancelled."""

    async def scenario() -> None:
        responder = Responder(lambda outputs: outputs["text"], lambda message, code: message, 1, print)
        try:
            flights = Flights(1, 0)
            sender = Sender()
            flight = flights.admit(sender)
            assert await flight.wait_for_slot()
            assert responder.send(flight, {"text": "token"}, final=False)
            assert responder.fail(flight, "engine died", None)  # the monitor ends it
            assert not responder.send(flight, {"text": "late token"}, final=True)  # its task, later
            assert not responder.fail(flight, "second error", None)
            assert flight.closed and flights.counts() == (0, 0)
            # A flight ended while it waited for a slot never takes one.
            flights = Flights(1, 1)
            first, second = flights.admit(Sender()), flights.admit(Sender())
            assert await first.wait_for_slot()
            waiter = asyncio.create_task(second.wait_for_slot())
            second.close()
            first.close()
            assert not await waiter and await flights.admit(Sender()).wait_for_slot()
        finally:
            responder.stop()
        assert sender.sent == [("token", 0), ("engine died", 1)]
        assert sender.asked == 1  # before the token; never once the final response went

    asyncio.run(scenario())


def test_a_client_that_went_away_is_found_by_the_responder_and_gets_nothing_more():
    async def scenario() -> tuple[Sender, object]:
        responder = Responder(lambda outputs: outputs["text"], lambda message, code: message, 1, print)
        flights = Flights(1, 0)
        sender = Sender()
        flight = flights.admit(sender)
        responder.send(flight, {"text": "a"}, final=False)
        assert wait_for(lambda: sender.sent)
        sender.cancelled = True
        responder.probe(flight)  # a response that sends nothing still asks
        responder.send(flight, {"text": "b"}, final=False)
        responder.fail(flight, "request was cancelled", None)  # what the loop then sends
        responder.stop()
        return sender, flight

    sender, flight = asyncio.run(scenario())
    assert flight.client_gone
    assert sender.sent == [("a", 0), ("request was cancelled", 1)]


class FakeEngine(LocalEngine):
    def __init__(self, name: str, pid: int) -> None:
        super().__init__(name, "127.0.0.1:1")
        self.pid, self.fail, self.hang = pid, None, False

    def health(self) -> dict:
        while self.hang:
            time.sleep(0.01)
        if self.fail:
            raise EngineError(self.fail)
        return {"pid": self.pid, "loop_alive": True, "step_age_s": 0.0}


def wait_for(condition, timeout=5.0) -> bool:
    deadline = time.monotonic() + timeout
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.01)
    return condition()


def test_monitor_sees_a_killed_stub_a_failed_probe_and_a_return():
    child = subprocess.Popen(["sleep", "60"])
    engines = [FakeEngine("e0", child.pid), FakeEngine("e1", os.getpid())]
    events: list[tuple] = []
    monitor = EngineMonitor(engines, lambda i, why: events.append(("down", i, why)),
                            lambda i: events.append(("up", i)), interval_s=0.02, timeout_s=0.5)  # fmt: skip
    monitor.start()
    try:
        assert wait_for(lambda: monitor._pids[0] == child.pid)
        child.kill()
        child.wait()
        assert wait_for(lambda: events) and events[0][:2] == ("down", 0)
        assert f"stub process {child.pid} exited" in events[0][2]
        engines[1].fail = "Stub process 'e1' is not healthy."
        assert wait_for(lambda: len(events) == 2) and events[1] == ("down", 1, engines[1].fail)
        engines[1].fail = None  # the engine answers again: it rejoins, once
        assert wait_for(lambda: len(events) == 3) and events[2] == ("up", 1)
        time.sleep(0.1)
        assert len(events) == 3
    finally:
        monitor.stop()


def test_monitor_probes_a_joining_engine_and_says_once_that_it_does_not_answer():
    engines = [FakeEngine("e0", os.getpid())]
    events: list[tuple] = []
    warnings: list[str] = []
    monitor = EngineMonitor(engines, lambda i, why: events.append(("down", i, why)),
                            lambda i: events.append(("up", i)), 0.02, 5.0, warnings.append)  # fmt: skip
    monitor.start()
    try:
        newcomer = FakeEngine("e1", os.getpid())
        newcomer.fail = "Request for unknown model: 'e1' is not found"
        monitor.watch(1, newcomer)
        assert wait_for(lambda: warnings)
        time.sleep(0.2)  # probes keep failing: said once, and never "down" (it was never up)
        assert warnings == [f"engine e1 joined but fails its health probe ({newcomer.fail}); it takes "
                            "requests once it answers"] and events == []  # fmt: skip
        newcomer.fail = None
        assert wait_for(lambda: events == [("up", 1)])
        monitor.unwatch(1)
        newcomer.fail = "gone"
        time.sleep(0.2)
        assert events == [("up", 1)]  # an engine that left is not reported
    finally:
        monitor.stop()


def test_monitor_waits_for_a_silent_engine_only_while_its_tokens_stop_too():
    engine = FakeEngine("e0", os.getpid())
    downs: list[str] = []
    monitor = EngineMonitor([engine], lambda i, why: downs.append(why), lambda i: None, 0.02, 0.3)
    engine.hang = True  # the probe's answer queues behind a burst of token responses...
    monitor.start()
    try:
        for _ in range(40):  # ...while tokens keep arriving: alive
            monitor.progress(0)
            time.sleep(0.02)
        assert downs == []
        assert wait_for(lambda: downs)  # nothing at all for longer than the timeout: down
        assert "answered nothing" in downs[0]
    finally:
        engine.hang = False
        monitor.stop()


class SilentEngine:
    """A gRPC endpoint that takes every ``ModelStreamInfer`` stream and never answers, as
    a killed engine stub's model does in Triton 2.51; it counts the streams it holds."""

    def __init__(self) -> None:
        import grpc
        from tritonclient.grpc import service_pb2_grpc

        class Servicer(service_pb2_grpc.GRPCInferenceServiceServicer):
            def ModelStreamInfer(inner, requests, context):  # noqa: N802, N805 (gRPC's name)
                next(requests)
                with self.lock:
                    self.open += 1
                done = threading.Event()
                context.add_callback(done.set)  # the client cancelled or went away
                done.wait()
                with self.lock:
                    self.open -= 1
                return iter(())

        from concurrent.futures import ThreadPoolExecutor

        self.lock, self.open = threading.Lock(), 0
        self.server = grpc.server(ThreadPoolExecutor(8))
        service_pb2_grpc.add_GRPCInferenceServiceServicer_to_server(Servicer(), self.server)
        self.url = f"127.0.0.1:{self.server.add_insecure_port('127.0.0.1:0')}"
        self.server.start()


@pytest.fixture
def silent_engine():
    engine = SilentEngine()
    yield engine
    engine.server.stop(0)


def test_streams_to_an_engine_that_never_answers_are_cancelled_and_end(silent_engine):
    """A request waiting on a dead engine holds its client's request, and with it the
    router model: Triton could never unload it, and tritonserver never exits. Cancelling
    from another thread (the monitor's) ends the engine's stream on the loop, with both
    requests on it, and a probe."""
    engine = RemoteEngine(silent_engine.url, "preble_engine_0")
    errors: list[str] = []
    loop = asyncio.new_event_loop()
    loop_thread = threading.Thread(target=loop.run_forever)
    loop_thread.start()

    async def generate() -> None:
        try:
            async for _ in engine.generate(uuid.uuid4().hex, [1, 2], "{}"):
                pass
        except EngineError as exc:
            errors.append(str(exc))

    def probe() -> None:
        try:
            engine.health()
        except EngineError as exc:
            errors.append(str(exc))

    streams = [asyncio.run_coroutine_threadsafe(generate(), loop) for _ in range(2)]
    prober = threading.Thread(target=probe)
    prober.start()
    try:
        assert wait_for(lambda: silent_engine.open == 2)  # the requests' stream, the probe's call
        assert engine.cancel_all() == 3  # two requests and a probe
        for stream in streams:
            stream.result(5)
        prober.join(5)
        assert not prober.is_alive()
        assert len(errors) == 3 and all("unreachable: CANCELLED" in e for e in errors), errors
        assert wait_for(lambda: silent_engine.open == 0)  # the server saw each stream end
        assert engine.cancel_all() == 0  # nothing left open
    finally:
        asyncio.run_coroutine_threadsafe(engine.aclose(), loop).result(5)
        loop.call_soon_threadsafe(loop.stop)
        loop_thread.join(5)
        engine.close()


def test_stopping_the_monitor_cancels_a_probe_that_would_never_return(silent_engine):
    """finalize must not return while a probe thread is inside gRPC (the stub's interpreter
    would shut down under it), nor wait on an engine that will never answer."""
    engine = FakeEngine("e0", os.getpid())
    monitor = EngineMonitor([engine], lambda i, why: None, lambda i: None, 0.02, 5.0)
    engine.hang = True
    monitor.start()
    assert wait_for(lambda: monitor._probing)  # a probe is blocked in health()
    threading.Timer(0.3, lambda: setattr(engine, "hang", False)).start()
    started = time.monotonic()
    monitor.stop()
    assert time.monotonic() - started >= 0.25 and not monitor._probes[0].is_alive()
    downs: list[str] = []
    silent = RemoteEngine(silent_engine.url, "preble_engine_0")
    stuck = EngineMonitor([silent], lambda i, why: downs.append(why), lambda i: None, 0.02, 5.0)
    stuck.start()
    assert wait_for(lambda: silent_engine.open == 1)
    started = time.monotonic()
    stuck.stop()
    assert time.monotonic() - started < 1.0 and not stuck._probes[0].is_alive()
    assert downs == []  # the cancelled probe is shutdown, not the engine failing
    silent.close()


def test_process_alive():
    assert process_alive(os.getpid())
    child = subprocess.Popen(["true"])
    time.sleep(0.2)  # exited but not reaped: a zombie is not alive
    assert not process_alive(child.pid)
    child.wait()
    assert not process_alive(child.pid)


def test_remote_engine_refuses_fast_when_nothing_listens():
    from preble_backend.runtime.launcher import free_port

    engine = RemoteEngine(f"127.0.0.1:{free_port()}", "preble_engine_0")
    started = time.monotonic()
    with pytest.raises(EngineError, match="unreachable: UNAVAILABLE"):
        engine.health()
    assert time.monotonic() - started < 5
    engine.close()


def test_router_load_checks_its_local_engines(tmp_path):
    from preble_backend.router.engines.loopback import check_local_engines
    from preble_backend.runtime.repository import write_repository

    repo = write_repository(tmp_path / "repo", cpu_engines=2, page_size=32)
    check_local_engines(repo, ["preble_engine_0", "preble_engine_1"], 32)
    with pytest.raises(ValueError, match="model 'preble_engine_7' is not in the model repository"):
        check_local_engines(repo, ["preble_engine_7"], 32)
    with pytest.raises(
        ValueError, match="page_size=16 is invalid: engine 'preble_engine_0' pages its KV cache by 32"
    ):
        check_local_engines(repo, ["preble_engine_0"], 16)
    config = repo / "preble_engine_1" / "config.pbtxt"
    config.write_text(config.read_text().replace("decoupled: true", "decoupled: false"))
    with pytest.raises(ValueError, match="model 'preble_engine_1' is not decoupled"):
        check_local_engines(repo, ["preble_engine_1"], 32)


def test_server_failure_names_each_model_and_skips_cpu_warnings(tmp_path):
    from preble_backend.runtime.launcher import ServerPorts, TritonServer

    log = tmp_path / "server.log"
    log.write_text(
        'E1123 02:11:31.417073 5192 server.cc:241] "CudaDriverHelper has not been initialized."\n'
        "E1123 02:11:40.1 5192 model_lifecycle.cc:654] \"failed to load 'preble' version 1: "
        "Invalid argument: ValueError: policy='nope' is invalid\"\n"
        'E1123 02:11:40.2 5192 model_repository_manager.cc:703] "failed to load all models"\n'
    )
    server = TritonServer(None, ServerPorts(), log, tmp_path)
    assert server.failure() == (
        "model preble failed to load: Invalid argument: ValueError: policy='nope' is invalid"
    )


def test_one_request_whose_sampling_fails_ends_alone(tiny_model, make_engine):
    engine = make_engine(tiny_model, page_size=8, chunk_size=64, max_num_tokens=2048)
    outputs: dict[str, list] = {}
    for rid in ("a", "bad", "b"):
        engine.add_request(rid, [5, 6, 7, 8], {"max_tokens": 6, "temperature": 0},
                           lambda out: outputs.setdefault(out.request_id, []).append(out))  # fmt: skip

    class Broken:  # a sampler state that fails mid-generation, as a bad value would
        params = SamplingParams(temperature=0.5)
        generator = "not a generator"

    engine._requests["bad"].sampler = Broken()
    while engine.has_work():
        engine.step()
    assert outputs["bad"][-1].error is not None and "sampling failed" in outputs["bad"][-1].error
    for rid in ("a", "b"):
        assert outputs[rid][-1].finish_reason == "length"
        assert sum(len(o.token_ids) for o in outputs[rid]) == 6
    assert engine.pool.num_used == engine.cache.num_pages  # every private page came back


def test_a_request_that_breaks_the_forward_pass_fails_alone(tiny_model, make_engine):
    engine = make_engine(tiny_model, page_size=8, chunk_size=64, max_num_tokens=2048)
    reference = make_engine(tiny_model, page_size=8, chunk_size=64, max_num_tokens=2048)
    prompts = {"a": [5, 6, 7, 8], "bad": [9, 10, 11], "b": [12, 13, 14, 15, 16]}
    greedy = {"max_tokens": 5, "temperature": 0}
    expected = dict(zip(("a", "b"), reference.generate([prompts["a"], prompts["b"]], greedy)))
    forward = engine.runner.forward

    def breaks_with_bad(batch, pool):
        if any(r.request_id == "bad" for r in batch.requests) and any(r.output_ids for r in batch.requests):
            raise RuntimeError("kernel failed")
        return forward(batch, pool)

    engine.runner.forward = breaks_with_bad
    outputs: dict[str, list] = {}
    for rid, prompt in prompts.items():
        engine.add_request(
            rid, prompt, greedy, lambda out: outputs.setdefault(out.request_id, []).append(out)
        )
    while engine.has_work():
        engine.step()
    assert "engine iteration failed: kernel failed" in outputs["bad"][-1].error
    for rid in ("a", "b"):
        assert [t for o in outputs[rid] for t in o.token_ids] == expected[rid]
    assert engine.pool.num_used == engine.cache.num_pages
