"""``preble serve`` as a service: secure by default, no request lost to an engine's death,
engines restarted, honest readiness, status codes clients retry on, a drain on SIGTERM.
Every test runs the real stack: the front, the router's tritonserver and one
tritonserver per engine."""

from __future__ import annotations

import base64
import json
import os
import re
import signal
import threading
import time
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
from server_utils import Stack, http, serve_stack, wait_for, write_test_repository

from client.triton_client import PrebleClient, PrebleError, open_grpc, stream_infer
from preble_backend.common.procfs import command_line, command_name, process_alive, process_tree
from preble_backend.runtime.access import admin_key_file

pytestmark = pytest.mark.server

GEN = "/v2/models/preble/generate"


def body(prompt: str = "Hello", **params) -> bytes:
    params.setdefault("max_tokens", 4)
    return json.dumps({"text_input": prompt, "sampling_parameters": json.dumps(params)}).encode()


def listening_addresses(pid: int) -> list[str]:
    """The local addresses of every listening TCP socket of ``pid``'s process tree."""
    inodes = set()
    for p in process_tree(pid):
        try:
            for fd in Path(f"/proc/{p}/fd").iterdir():
                target = os.readlink(fd)
                if target.startswith("socket:["):
                    inodes.add(target[8:-1])
        except OSError:
            continue
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] == "0A" and fields[9] in inodes:  # LISTEN
                found.append(fields[1].split(":")[0])
    return found


LOOPBACK = {"0100007F", "0000000000000000FFFF00000100007F", "00000000000000000000000001000000"}


def router_pid(stack: Stack) -> int:
    """The router's tritonserver: the one serving the run directory's router repository."""

    def serves_router(pid: int) -> bool:
        args = command_line(pid)
        return any(a.startswith(b"--model-repository=") and a.endswith(b"/router") for a in args)

    return next(p for p in process_tree(stack.process.pid) if serves_router(p))


def engine_grpc_port(stack: Stack, model: str) -> int:
    stub = stack.engine_stub(model)
    parent = Path(f"/proc/{stub}/stat").read_text().rsplit(")", 1)[1].split()[1]
    args = command_line(int(parent))
    return int(next(a for a in args if a.startswith(b"--grpc-port=")).split(b"=")[1])


def test_everything_listens_on_loopback_only(stack):
    addresses = listening_addresses(stack.process.pid)
    assert len(addresses) >= 2 + 3 * 3, addresses  # the front's two, three per tritonserver
    assert set(addresses) <= LOOPBACK, addresses


def _load_with_code(marker: Path) -> tuple[str, str, bytes]:
    """A model-load request whose ``file:`` override would write ``marker`` if it ran."""
    code = f"open({str(marker)!r}, 'w').write('x')\nclass TritonPythonModel:\n    pass\n"
    config = json.dumps({"backend": "python"})
    load = json.dumps(
        {"parameters": {"config": config, "file:1/model.py": base64.b64encode(code.encode()).decode()}}
    ).encode()
    return code, config, load


def test_no_key_makes_the_server_run_uploaded_code_or_unload_the_router(stack, tmp_path):
    marker = tmp_path / "pwned"
    code, config, load = _load_with_code(marker)
    changes = [
        ("/v2/repository/models/pwn/load", load),
        ("/v2/repository/models/preble/unload", b"{}"),
        ("/v2/logging", b'{"log_verbose_level": 1}'),
        ("/v2/trace/setting", b"{}"),
        ("/v2/systemsharedmemory/region/r/register", b'{"key": "/r", "offset": 0, "byte_size": 64}'),
    ]
    for path, data in changes:
        status, _, answer = http("POST", stack.url(path), data)
        assert status == 403 and (b"restricted" in answer or b"disabled" in answer), (path, status, answer)
    import tritonclient.grpc as grpcclient
    from tritonclient.utils import InferenceServerException

    client = grpcclient.InferenceServerClient(f"127.0.0.1:{stack.ports.grpc}")
    upload = {"file:1/model.py": code.encode()}
    for change in (lambda: client.load_model("pwn", config=config, files=upload),
                   lambda: client.unload_model("preble")):  # fmt: skip
        with pytest.raises(InferenceServerException, match="model control 'none'") as refused:
            change()
        assert refused.value.status() == "StatusCode.PERMISSION_DENIED"
    key = admin_key_file(stack.ports.grpc)
    assert key.stat().st_mode & 0o777 == 0o600
    admin = {"authorization": f"Bearer {key.read_text()}"}
    # Not even the admin key loads a model: the servers run with model control "none".
    for path, data in changes[:2]:
        status, _, answer = http("POST", stack.url(path), data, admin)
        assert status == 403 and b"model control 'none'" in answer, (path, status, answer)
    with pytest.raises(InferenceServerException, match="model control 'none'"):
        client.load_model("pwn", config=config, files={"file:1/model.py": code.encode()},
                          headers={"triton-grpc-protocol-authorization": admin["authorization"]})  # fmt: skip
    with pytest.raises(InferenceServerException, match="admin API") as refused:
        client.update_log_settings({"log_verbose_level": 1})
    assert refused.value.status() == "StatusCode.UNAUTHENTICATED"
    assert client.get_log_settings(headers=admin)  # the admin key, as gRPC clients send it plainly
    assert not marker.exists()
    assert http("POST", stack.url(GEN), body())[0] == 200  # the router still serves
    status, _, index = http("POST", stack.url("/v2/repository/index"), b"{}", admin)
    assert status == 200 and json.loads(index) == [{"name": "preble", "version": "1", "state": "READY"}]


def test_the_admin_control_request_switches_the_policy_with_the_admin_key_only(stack):
    grpc = f"127.0.0.1:{stack.ports.grpc}"
    admin_key = admin_key_file(stack.ports.grpc).read_text()
    for wrong in (None, "guess"):
        with pytest.raises(PrebleError, match="admin control needs the admin key"):
            PrebleClient(grpc_url=grpc).admin("configure", wrong, policy="round_robin")
    ask = {"parameters": {"preble_admin": "status", "preble_admin_key": "guess"}}
    status, _, answer = http("POST", stack.url(GEN), json.dumps(ask).encode())
    assert status == 403 and b"admin key" in answer, answer
    client = PrebleClient(grpc_url=grpc)
    state = client.admin("configure", admin_key, policy="round_robin")
    assert state["policy"] == "round_robin"
    assert sorted(state["flushed"]) == ["preble_engine_0", "preble_engine_1"]
    engines = {client.stream_grpc(f"request {i}", {"max_tokens": 2}).final["instance"] for i in range(2)}
    assert engines == {"preble_engine_0", "preble_engine_1"}  # round robin alternates
    assert client.admin("configure", admin_key, policy="e2")["policy"] == "e2"
    assert client.admin("status", admin_key)["engines"] == {"preble_engine_0": True, "preble_engine_1": True}


def test_malformed_bodies_of_every_kind_are_refused_and_every_server_lives(stack):
    """Classes of hostile body, each refused with a 4xx that names the problem: none
    reaches tritonserver's HTTP parser as sent, and no process of the stack dies."""
    before = stack.pids()
    form, binary = {"Content-Type": "application/x-www-form-urlencoded"}, "Inference-Header-Content-Length"
    big = body("a " * 3_000_000)  # 6 MB: Triton 2.51's own listener died on this
    cases = [
        (big, form, 400, b"max_input_bytes"),
        (big, {**form, binary: str(len(big))}, 400, b"max_input_bytes"),  # the header that crashed it
        (b"x" * (5 << 20), {**form, binary: "0"}, 400, b"not valid JSON"),
        (b"x" * (5 << 20), form, 400, b"not valid JSON"),
        (body(), {binary: "-1"}, 400, b"is invalid"),
        (body(), {binary: str(10**9)}, 400, b"is invalid"),
        (body(), {binary: "12abc"}, 400, b"is invalid"),
        (b"[" * 100_000 + b"]" * 100_000, {}, 400, b"nested too deeply"),
        (b'{"text_input": "\xff\xfe"}', {}, 400, b"not valid JSON"),
        (rb'{"text_input": "\ud800", "sampling_parameters": "{}"}', {}, 400, b""),
        (b'{"text_input": NaN}', {}, 400, b"not valid JSON"),
        (b'{"text_input": "hi", "text_input": 1e999999}', {}, 400, b""),
        (b"\x00" * 1000, {"Content-Type": "application/octet-stream"}, 400, b"not valid JSON"),
        (b"x" * (50 << 20), form, 413, b"--max-body-bytes"),
    ]
    for data, headers, status, words in cases:
        got, _, answer = http("POST", stack.url(GEN), data, headers)
        assert got == status and words in answer, (data[:60], headers, got, answer[:300])
    openai = stack.url("/v1/completions", stack.openai_port)
    got, _, answer = http("POST", openai, b'{"prompt": "' + b"a" * (40 << 20) + b'"}',
                          {"Content-Type": "application/json"})  # fmt: skip
    assert got == 413 and b"--max-body-bytes" in answer, answer[:300]
    assert http("GET", stack.url("/v2/health/ready"))[0] == 200
    assert http("POST", stack.url(GEN), body(), form)[0] == 200  # curl -d's small bodies still work
    assert stack.pids() == before


def test_the_metrics_port_carries_the_router_and_every_engine(stack):
    """One scrape target per ``preble serve``: the router's series and each engine
    server's, labelled by engine, every family declared once."""
    assert http("POST", stack.url(GEN), body())[0] == 200
    status, _, answer = http("GET", f"http://127.0.0.1:{stack.ports.metrics}/metrics")
    lines = answer.decode().splitlines()
    assert status == 200 and any(ln.startswith("preble_router_engine_up{") for ln in lines)
    for engine in ("preble_engine_0", "preble_engine_1"):
        assert any(ln.startswith(f'preble_engine_kv_pages_free{{engine="{engine}",') for ln in lines), engine
        assert any(ln.startswith(f'nv_inference_count{{engine="{engine}",') for ln in lines), engine
    types = [ln.split()[2] for ln in lines if ln.startswith("# TYPE ")]
    assert len(types) == len(set(types))
    assert listening_addresses(stack.process.pid)  # (the port is the front's, on loopback like the rest)


def test_client_errors_are_4xx_on_both_apis(stack):
    status, _, answer = http("POST", stack.url(GEN), body(max_tokens=100_000))
    assert status == 400 and b"over the model's context length" in answer, answer
    request = json.dumps({"model": "preble", "prompt": "hi", "max_tokens": 1_000_000}).encode()
    status, _, answer = http("POST", stack.url("/v1/completions", stack.openai_port), request,
                             {"Content-Type": "application/json"})  # fmt: skip
    error = json.loads(answer)["error"]
    assert status == 400 and error["type"] == "invalid_request_error", answer
    assert "over the model's context length" in error["message"]


def test_an_api_key_guards_every_api_but_health(tmp_path, tiny_model):
    repo = write_test_repository(tmp_path / "repo", cpu_engines=1)
    stack = serve_stack(repo, env={"PREBLE_API_KEY": "s3cret"})
    try:
        good, bad = {"authorization": "Bearer s3cret"}, {"authorization": "Bearer guess"}
        assert http("POST", stack.url(GEN), body())[0] == 401
        assert http("POST", stack.url(GEN), body(), bad)[0] == 401
        assert http("POST", stack.url(GEN), body(), good)[0] == 200
        openai = stack.url("/v1/models", stack.openai_port)
        status, _, answer = http("GET", openai, headers=bad)
        assert status == 401 and json.loads(answer)["error"]["type"] == "authentication_error"
        assert http("GET", openai, headers=good)[0] == 200
        ask = json.dumps({"model": "preble", "input": "Hello", "max_output_tokens": 2}).encode()
        responses, typed = stack.url("/v1/responses", stack.openai_port), {"content-type": "application/json"}
        assert http("POST", responses, ask, typed)[0] == 401
        assert http("POST", responses, ask, {**typed, **good})[0] == 200
        assert http("GET", stack.url("/health", stack.openai_port))[0] == 200
        assert http("GET", stack.url("/v2/health/ready"))[0] == 200
        grpc = f"127.0.0.1:{stack.ports.grpc}"
        with pytest.raises(PrebleError, match="needs a valid API key"):
            PrebleClient(grpc_url=grpc).stream_grpc("Hello", {"max_tokens": 2})
        assert PrebleClient(grpc_url=grpc, api_key="s3cret").stream_grpc("Hello", {"max_tokens": 2}).text
        marker = tmp_path / "pwned"
        _, _, load = _load_with_code(marker)
        status, _, answer = http("POST", stack.url("/v2/logging"), b'{"log_verbose_level": 1}', good)
        assert status == 403 and b"restricted" in answer, answer  # the API key is not the admin key
        status, _, answer = http("POST", stack.url("/v2/repository/models/pwn/load"), load, good)
        assert status == 403, answer
        import tritonclient.grpc as grpcclient
        from tritonclient.utils import InferenceServerException

        # gRPC: the status a client acts on (Triton's own is UNAVAILABLE, which clients retry)
        client, admin = grpcclient.InferenceServerClient(grpc), admin_key_file(stack.ports.grpc).read_text()
        as_admin = {"authorization": f"Bearer {admin}"}
        calls = {
            "no key": (lambda: client.get_model_metadata("preble"), "UNAUTHENTICATED"),
            "a wrong key": (lambda: client.get_model_metadata("preble", headers=bad), "UNAUTHENTICATED"),
            "API key, admin API": (lambda: client.get_log_settings(headers=good), "PERMISSION_DENIED"),
            "admin key, inference": (lambda: client.get_model_metadata("preble", headers=as_admin),
                                     "PERMISSION_DENIED"),
            "unload, API key": (lambda: client.unload_model("preble", headers=good), "PERMISSION_DENIED"),
        }  # fmt: skip
        for what, (call, code) in calls.items():
            with pytest.raises(InferenceServerException) as refused:
                call()
            assert refused.value.status() == f"StatusCode.{code}", (what, refused.value)
        assert client.is_server_live() and client.is_model_ready("preble")  # probes need no key
        assert client.get_model_metadata("preble", headers=good).name == "preble"
        assert not marker.exists()
        assert admin_key_file(stack.ports.grpc).read_text() != "s3cret"
    finally:
        out, err = stack.stop()
    assert stack.process.returncode == 0, err


def test_at_capacity_the_answer_is_503_with_retry_after(tmp_path, tiny_model):
    repo = write_test_repository(tmp_path / "repo", cpu_engines=1, compute="emulated", emulated_slowdown=20.0,
                                 router_overrides={"max_inflight": 1, "max_queue": 0})  # fmt: skip
    stack = serve_stack(repo)
    try:
        answers = []

        def send(i: int) -> None:
            answers.append(http("POST", stack.url(GEN), body(max_tokens=64, ignore_eos=True)))

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
    router = router_pid(stack)

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
        assert router_pid(stack) == router  # the router's server never died
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
        request = body(f"stream {i}", max_tokens=600, ignore_eos=True)
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
        old = re.sub(r"preble_backend\.(router|engine_server)\.", "preble_backend.serving.",
                     model_py.read_text())
        assert "preble_backend.serving." in old
        model_py.write_text(old)
    stack = serve_stack(repo)
    try:
        warnings = [line for line in stack.lines if "warning" in line]
        assert len(warnings) == 1 and f"engine {remote} is unreachable" in warnings[0], stack.lines
        assert http("POST", stack.url(GEN), body())[0] == 200  # the local engine serves
    finally:
        stack.stop()


def test_the_router_server_is_restarted_and_its_streams_end_with_an_error(tmp_path, tiny_model):
    repo = write_test_repository(tmp_path / "repo", cpu_engines=1)
    stack = serve_stack(repo)
    try:
        deep = b'{"text_input": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"  # killed tritonserver 2.51
        status, _, answer = http("POST", stack.url(GEN), deep)
        assert status == 400 and b"nested too deeply" in answer, answer
        assert http("POST", stack.url(GEN), body())[0] == 200
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
        os.kill(router_pid(stack), signal.SIGKILL)
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
        wait_for(lambda: http("POST", stack.url(GEN), body())[0] == 200, 60, "the router's server restarting")
    finally:
        out, err = stack.stop()
    assert stack.process.returncode == 0, err
    assert "router preble failed" in out, out  # and was restarted: it answered again above
