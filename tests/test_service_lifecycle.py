"""``preble serve`` as a service over its life: no request lost to an engine's death,
engines restarted, honest readiness, status codes clients retry on at capacity, a drain
on SIGTERM, a restarted router server. Each test runs its own real stack: the front, the
router's tritonserver and one tritonserver per engine."""

from __future__ import annotations

import json
import os
import re
import signal
import threading
import time
from collections import Counter

import numpy as np
import pytest
from server_utils import GENERATE, Stack, generate_body, http, serve_stack, wait_for, write_test_repository

from client.triton_client import PrebleClient, PrebleError, open_grpc, stream_infer
from preble_backend.common.procfs import command_line, command_name, process_alive, process_tree

pytestmark = pytest.mark.server


def test_at_capacity_the_answer_is_503_with_retry_after(tmp_path, tiny_model):
    repo = write_test_repository(tmp_path / "repo", cpu_engines=1, compute="emulated", emulated_slowdown=20.0,
                                 router_overrides={"max_inflight": 1, "max_queue": 0})  # fmt: skip
    stack = serve_stack(repo)
    try:
        answers = []

        def send(i: int) -> None:
            answers.append(http("POST", stack.url(GENERATE), generate_body(max_tokens=64, ignore_eos=True)))

        threads = [threading.Thread(target=send, args=(i,)) for i in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        refused = [a for a in answers if a[0] != 200]
        assert refused and len(refused) < 4, [a[0] for a in answers]
        for status, headers, answer in refused:
            assert status == 503 and headers.get("retry-after") == "1" and b"at capacity" in answer, answer
        # A stream holds the one slot (its first tokens came) while each API asks.
        channel, stub = open_grpc(f"127.0.0.1:{stack.ports.grpc}")
        inputs = {
            "text_input": np.array([b"Hold the slot"], dtype=object),
            "stream": np.array([True]),
            "sampling_parameters": np.array([b'{"max_tokens": 400, "ignore_eos": true}'], dtype=object),
        }
        holder = stream_infer(stub, "preble", inputs, timeout=120)
        next(holder)
        streamed = json.dumps({"text_input": "Hi", "stream": True, "sampling_parameters": "{}"}).encode()
        status, headers, answer = http("POST", stack.url("/v2/models/preble/generate_stream"), streamed)
        assert status == 503 and headers.get("retry-after") == "1" and b"at capacity" in answer, answer
        chat = json.dumps({"model": "preble", "messages": [{"role": "user", "content": "Hi"}]}).encode()
        status, headers, answer = http("POST", stack.url("/v1/chat/completions", stack.openai_port), chat,
                                       {"Content-Type": "application/json"})  # fmt: skip
        assert status == 503 and headers.get("retry-after") == "1" and b"at capacity" in answer, answer
        with pytest.raises(PrebleError, match="at capacity"):
            PrebleClient(grpc_url=f"127.0.0.1:{stack.ports.grpc}").stream_grpc("Hi", {"max_tokens": 2})
        holder.close()  # cancels the stream
        channel.close()
    finally:
        stack.stop()


def engine_up(stack: Stack) -> dict[str, float]:
    text = http("GET", f"http://127.0.0.1:{stack.ports.metrics}/metrics")[2].decode()
    found = re.findall(r'preble_router_engine_up\{[^}]*engine="([^"]+)"[^}]*\} (\S+)', text)
    return {name: float(v) for name, v in found}


def migrations(stack: Stack) -> float:
    text = http("GET", f"http://127.0.0.1:{stack.ports.metrics}/metrics")[2].decode()
    return sum(float(v) for v in re.findall(r"preble_router_migrations_total\{[^}]*\} (\S+)", text))


def test_engine_deaths_migrate_requests_and_the_engines_come_back(tmp_path, tiny_model):
    """Ten times: four greedy streams run on two engines; one engine's stub is killed
    mid-stream. Every stream finishes with exactly the fault-free text, the router's
    server lives, readiness stays true (an engine is left), and the engine is back and
    taking requests within 30 s. Then both at once: the requests end with an error that
    says so, and readiness is false until they are back."""
    repo = write_test_repository(tmp_path / "repo", cpu_engines=2, router_overrides={"policy": "round_robin"})
    stack = serve_stack(repo)
    client = PrebleClient(grpc_url=f"127.0.0.1:{stack.ports.grpc}")
    prompts = [f"Request {i} asks about the weather in city {i * 7}." for i in range(4)]
    params = {"max_tokens": 96, "temperature": 0, "ignore_eos": True}
    reference = {p: client.stream_grpc(p, params).text for p in prompts}
    router = stack.router_server()

    def routed_to(engine: str) -> bool:  # round robin: two requests reach both engines
        answers = [client.stream_grpc("Hello", {"max_tokens": 2}).final["instance"] for _ in range(2)]
        return engine in answers

    try:
        for kill in range(10):
            victim = f"preble_engine_{kill % 2}"
            results: dict[str, str | Exception] = {}

            def run(prompt: str, results=results) -> None:
                try:
                    results[prompt] = client.stream_grpc(prompt, params, timeout=120).text
                except Exception as exc:
                    results[prompt] = exc

            threads = [threading.Thread(target=run, args=(p,)) for p in prompts]
            for t in threads:
                t.start()
            time.sleep(0.4)  # the streams are under way
            os.kill(stack.engine_stub(victim), signal.SIGKILL)
            for t in threads:
                t.join(timeout=180)
            assert results == reference, f"kill {kill}: {results}"
            assert http("GET", stack.url("/v2/health/ready"))[0] == 200
            back = lambda v=victim: engine_up(stack).get(v) == 1.0 and routed_to(v)  # noqa: E731
            wait_for(back, 30, f"{victim} rejoining and taking requests")
        assert migrations(stack) >= 10  # requests did move, at least one per kill
        assert stack.router_server() == router  # the router's server never died
        assert stack.process.poll() is None
        for victim in ("preble_engine_0", "preble_engine_1"):
            os.kill(stack.engine_stub(victim), signal.SIGKILL)
        with pytest.raises(PrebleError, match="no engine is available|failed|unreachable"):
            client.stream_grpc(prompts[0], params, timeout=60)
        assert http("GET", stack.url("/v2/health/ready"))[0] == 503
        import tritonclient.grpc as grpcclient

        probe = grpcclient.InferenceServerClient(f"127.0.0.1:{stack.ports.grpc}")
        assert not probe.is_server_ready() and not probe.is_model_ready("preble")  # gRPC is as honest
        wait_for(lambda: http("GET", stack.url("/v2/health/ready"))[0] == 200, 60, "readiness")
        assert probe.is_server_ready() and probe.is_model_ready("preble")
        assert client.stream_grpc(prompts[0], params).text == reference[prompts[0]]
    finally:
        out, err = stack.stop()
    assert stack.process.returncode == 0, err
    for model in ("preble_engine_0", "preble_engine_1"):  # (Triton itself sometimes restarts a stub)
        assert f"engine {model} is back" in out, out


def test_sigterm_drains_fifty_streams_and_exits_zero(tmp_path, tiny_model):
    """50 streams over Triton HTTP (SSE), the OpenAI API and gRPC; SIGTERM with a 2 s
    drain: every client gets its whole answer or an error message, the exit code is 0,
    and no process is left."""
    repo = write_test_repository(tmp_path / "repo", cpu_engines=2)
    stack = serve_stack(repo, "--drain-timeout", "2")
    outcomes: list[str] = []

    def sse(i: int) -> None:
        request = generate_body(f"stream {i}", max_tokens=600, ignore_eos=True)
        status, _, answer = http("POST", stack.url("/v2/models/preble/generate_stream"), request, timeout=120)
        events = [json.loads(line[5:]) for line in answer.decode().splitlines() if line.startswith("data:")]
        if status != 200:
            outcomes.append(f"error: http {status}: {answer[:80]!r}")
        elif events and "error" in events[-1]:
            outcomes.append(f"error: {events[-1]['error']}")
        else:
            outcomes.append("done" if events else "cut")

    def openai(i: int) -> None:
        request = json.dumps({"model": "preble", "prompt": f"open {i}", "max_tokens": 600, "stream": True,
                              "ignore_eos": True}).encode()  # fmt: skip
        status, _, answer = http("POST", stack.url("/v1/completions", stack.openai_port), request,
                                 {"Content-Type": "application/json"}, timeout=120)  # fmt: skip
        lines = [line[6:] for line in answer.decode().splitlines() if line.startswith("data: ")]
        if status != 200:
            outcomes.append(f"error: http {status}: {answer[:120]!r}")
        elif lines[-1:] != ["[DONE]"]:
            outcomes.append("cut")
        elif errors := [e["error"] for e in map(json.loads, lines[:-1]) if "error" in e]:
            outcomes.append(f"error: {errors[0]['message']}")
        else:
            outcomes.append("done")

    def grpc(i: int) -> None:
        try:
            PrebleClient(grpc_url=f"127.0.0.1:{stack.ports.grpc}").stream_grpc(
                f"grpc {i}", {"max_tokens": 600, "ignore_eos": True}, timeout=120
            )
            outcomes.append("done")
        except PrebleError as exc:
            outcomes.append(f"error: {exc}")

    kinds = [sse, openai, grpc]
    threads = [threading.Thread(target=kinds[i % 3], args=(i,)) for i in range(50)]
    for t in threads:
        t.start()
    time.sleep(1.5)
    tree = process_tree(stack.process.pid)
    out, err = stack.stop()
    for t in threads:
        t.join(timeout=60)
    assert stack.process.returncode == 0, err
    assert len(outcomes) == 50, outcomes
    ended = all(o == "done" or ("shutting down" in o and o.startswith("error")) for o in outcomes)
    assert ended, str(Counter(outcomes))
    assert any("shutting down" in o for o in outcomes)  # 600 tokens each do not fit in 2 s here
    deadline = time.monotonic() + 5  # a stub's watcher notices within half a second
    while (left := [p for p in tree if process_alive(p)]) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not left, [(p, command_name(p), b" ".join(command_line(p))[:200]) for p in left]


def test_start_up_names_an_unreachable_remote_engine(tmp_path, tiny_model):
    """Also: a repository written by the layout before the rooms (its model.py files import
    the entry points from preble_backend.serving) still serves."""
    from preble_backend.runtime.launcher import free_port

    remote = f"grpc://127.0.0.1:{free_port()}/preble_engine_0"  # nothing listens there
    repo = write_test_repository(tmp_path / "repo", cpu_engines=1, remote_engines=[remote])
    for model_py in repo.glob("*/1/model.py"):
        old = re.sub(
            r"preble_backend\.(router|engine_server)\.", "preble_backend.serving.", model_py.read_text()
        )
        assert "preble_backend.serving." in old
        model_py.write_text(old)
    stack = serve_stack(repo)
    try:
        warnings = [line for line in stack.lines if "warning" in line]
        assert len(warnings) == 1 and f"engine {remote} is unreachable" in warnings[0], stack.lines
        assert http("POST", stack.url(GENERATE), generate_body())[0] == 200  # the local engine serves
    finally:
        stack.stop()


def test_the_router_server_is_restarted_and_its_streams_end_with_an_error(tmp_path, tiny_model):
    repo = write_test_repository(tmp_path / "repo", cpu_engines=1)
    stack = serve_stack(repo)
    try:
        deep = b'{"text_input": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"  # killed tritonserver 2.51
        status, _, answer = http("POST", stack.url(GENERATE), deep)
        assert status == 400 and b"nested too deeply" in answer, answer
        assert http("POST", stack.url(GENERATE), generate_body())[0] == 200
        streams: list[tuple[int, list[dict]]] = []

        def sse(i: int) -> None:
            params = json.dumps({"max_tokens": 2000, "ignore_eos": True})
            request = json.dumps({"text_input": f"stream {i}", "stream": True, "sampling_parameters": params})
            status, _, answer = http("POST", stack.url("/v2/models/preble/generate_stream"), request.encode(),
                                     timeout=120)  # fmt: skip
            streams.append((status, [json.loads(line[5:]) for line in answer.decode().splitlines()
                                     if line.startswith("data:")]))  # fmt: skip

        grpc_ends: list[str] = []

        def grpc(i: int) -> None:
            channel, stub = open_grpc(f"127.0.0.1:{stack.ports.grpc}")
            inputs = {
                "text_input": np.array([f"grpc {i}".encode()], dtype=object),
                "stream": np.array([True]),
                "sampling_parameters": np.array([b'{"max_tokens": 2000, "ignore_eos": true}'], dtype=object),
            }
            try:
                for _outputs, final in stream_infer(stub, "preble", inputs, timeout=120):
                    if final:
                        grpc_ends.append("finished")
            except Exception as exc:  # what a cut gRPC stream raises
                grpc_ends.append(f"{getattr(exc, 'code', lambda: '')()} {exc}")
            finally:
                channel.close()

        threads = [threading.Thread(target=sse, args=(i,)) for i in range(4)]
        threads += [threading.Thread(target=grpc, args=(i,)) for i in range(2)]
        for t in threads:
            t.start()
        time.sleep(3)  # the streams are under way
        os.kill(stack.router_server(), signal.SIGKILL)
        chat = json.dumps({"model": "preble", "messages": [{"role": "user", "content": "Hi"}]}).encode()
        status, headers, answer = http("POST", stack.url("/v1/chat/completions", stack.openai_port), chat,
                                       {"Content-Type": "application/json"})  # fmt: skip
        assert status == 503 and headers.get("retry-after") == "1", (status, answer)  # not 500: retry
        for t in threads:
            t.join(timeout=120)
        assert len(streams) == 4
        for status, events in streams:  # an answer cut short is never a clean finish
            assert (status == 503 and not events) or "mid-stream" in events[-1].get("error", ""), events[-1:]
        assert sum(status == 200 for status, _ in streams) >= 2  # most were cut mid-stream
        assert len(grpc_ends) == 2 and all(
            "UNAVAILABLE" in end and "mid-stream" in end for end in grpc_ends
        ), grpc_ends
        status, headers, _ = http("GET", stack.url("/v2/health/ready"))
        assert status == 503 and headers.get("retry-after") == "1"
        answers = lambda: http("POST", stack.url(GENERATE), generate_body())[0] == 200  # noqa: E731
        wait_for(answers, 60, "the router's server restarting")
    finally:
        out, err = stack.stop()
    assert stack.process.returncode == 0, err
    assert "router preble failed" in out, out  # and was restarted: it answered again above
