"""``preble serve`` as a service, secure by default: loopback only, no key that runs
uploaded code, an admin key apart from the API key, hostile bodies refused with every
server alive, client errors as 4xx. Every test runs the real stack: the front, the
router's tritonserver and one tritonserver per engine (its life: test_service_lifecycle)."""

from __future__ import annotations

import base64
import json
import os
from pathlib import Path

import pytest
from server_utils import GENERATE, generate_body, http, serve_stack, write_test_repository

from client.triton_client import PrebleClient, PrebleError
from preble_backend.common.procfs import process_tree
from preble_backend.runtime.access import admin_key_file

pytestmark = pytest.mark.server


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
    assert http("POST", stack.url(GENERATE), generate_body())[0] == 200  # the router still serves
    status, _, index = http("POST", stack.url("/v2/repository/index"), b"{}", admin)
    assert status == 200 and json.loads(index) == [{"name": "preble", "version": "1", "state": "READY"}]


def test_the_admin_control_request_switches_the_policy_with_the_admin_key_only(stack):
    grpc = f"127.0.0.1:{stack.ports.grpc}"
    admin_key = admin_key_file(stack.ports.grpc).read_text()
    for wrong in (None, "guess"):
        with pytest.raises(PrebleError, match="admin control needs the admin key"):
            PrebleClient(grpc_url=grpc).admin("configure", wrong, policy="round_robin")
    ask = {"parameters": {"preble_admin": "status", "preble_admin_key": "guess"}}
    status, _, answer = http("POST", stack.url(GENERATE), json.dumps(ask).encode())
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
    big = generate_body("a " * 3_000_000)  # 6 MB: Triton 2.51's own listener died on this
    cases = [
        (big, form, 400, b"max_input_bytes"),
        (big, {**form, binary: str(len(big))}, 400, b"max_input_bytes"),  # the header that crashed it
        (b"x" * (5 << 20), {**form, binary: "0"}, 400, b"not valid JSON"),
        (b"x" * (5 << 20), form, 400, b"not valid JSON"),
        (generate_body(), {binary: "-1"}, 400, b"is invalid"),
        (generate_body(), {binary: str(10**9)}, 400, b"is invalid"),
        (generate_body(), {binary: "12abc"}, 400, b"is invalid"),
        (b"[" * 100_000 + b"]" * 100_000, {}, 400, b"nested too deeply"),
        (b'{"text_input": "\xff\xfe"}', {}, 400, b"not valid JSON"),
        (rb'{"text_input": "\ud800", "sampling_parameters": "{}"}', {}, 400, b""),
        (b'{"text_input": NaN}', {}, 400, b"not valid JSON"),
        (b'{"text_input": "hi", "text_input": 1e999999}', {}, 400, b""),
        (b"\x00" * 1000, {"Content-Type": "application/octet-stream"}, 400, b"not valid JSON"),
        (b"x" * (50 << 20), form, 413, b"--max-body-bytes"),
    ]
    for data, headers, status, words in cases:
        got, _, answer = http("POST", stack.url(GENERATE), data, headers)
        assert got == status and words in answer, (data[:60], headers, got, answer[:300])
    openai = stack.url("/v1/completions", stack.openai_port)
    got, _, answer = http("POST", openai, b'{"prompt": "' + b"a" * (40 << 20) + b'"}',
                          {"Content-Type": "application/json"})  # fmt: skip
    assert got == 413 and b"--max-body-bytes" in answer, answer[:300]
    assert http("GET", stack.url("/v2/health/ready"))[0] == 200
    # curl -d's small bodies still work
    assert http("POST", stack.url(GENERATE), generate_body(), form)[0] == 200
    assert stack.pids() == before


def test_the_metrics_port_carries_the_router_and_every_engine(stack):
    """One scrape target per ``preble serve``: the router's series and each engine
    server's, labelled by engine, every family declared once."""
    assert http("POST", stack.url(GENERATE), generate_body())[0] == 200
    status, _, answer = http("GET", f"http://127.0.0.1:{stack.ports.metrics}/metrics")
    lines = answer.decode().splitlines()
    assert status == 200 and any(ln.startswith("preble_router_engine_up{") for ln in lines)
    for engine in ("preble_engine_0", "preble_engine_1"):
        assert any(ln.startswith(f'preble_engine_kv_pages_free{{engine="{engine}",') for ln in lines), engine
        assert any(ln.startswith(f'nv_inference_count{{engine="{engine}",') for ln in lines), engine
        # E2's cost model per engine (issue 63): the tiny model on the CPU starts from its shipped fit
        cost = {ln.split("{")[0] + ("/" + ln.split('term="')[1].split('"')[0] if "term=" in ln else ""):
                float(ln.split()[-1]) for ln in lines
                if ln.startswith("preble_router_cost_") and f'engine="{engine}"' in ln}  # fmt: skip
        assert cost["preble_router_cost_model_mismatch"] == 0, cost
        assert (
            cost["preble_router_cost_ms/prefill_per_token"] > 0 and "preble_router_cost_model_learnt" in cost
        )
    types = [ln.split()[2] for ln in lines if ln.startswith("# TYPE ")]
    assert len(types) == len(set(types))
    assert listening_addresses(stack.process.pid)  # (the port is the front's, on loopback like the rest)


def test_client_errors_are_4xx_on_both_apis(stack):
    status, _, answer = http("POST", stack.url(GENERATE), generate_body(max_tokens=100_000))
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
        assert http("POST", stack.url(GENERATE), generate_body())[0] == 401
        assert http("POST", stack.url(GENERATE), generate_body(), bad)[0] == 401
        assert http("POST", stack.url(GENERATE), generate_body(), good)[0] == 200
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
