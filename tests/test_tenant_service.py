"""Tenants on the real stack (issue 65): ``preble serve --keys-file``. Every API names the
request's tenant from its key, a tenant's key cannot name another tenant (by header or by
request parameter), a gateway's key can, a tenant over its cap gets 429, and the engines
count each tenant's service in ``preble_tenant_service_tokens_total``."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest
from server_utils import (
    GENERATE,
    generate_body,
    http,
    metric_value,
    serve_stack,
    wait_for,
    write_test_repository,
)

from client.triton_client import PrebleClient, PrebleError

pytestmark = pytest.mark.server
KEY_A, KEY_B, KEY_C, KEY_GW = ("sk-team-a-0123456789", "sk-team-b-0123456789", "sk-team-c-0123456789",
                               "sk-gateway-0123456789")  # fmt: skip
KEY_D = "sk-team-d-0123456789"
KEYS = f"""{KEY_A} team-a 1
{KEY_D} team-d 1 tokens_per_minute=10
{KEY_B} team-b 1 max_in_flight=1
{KEY_C} team-c 2
{KEY_GW} *
"""


def bearer(key: str) -> dict[str, str]:
    return {"authorization": f"Bearer {key}", "content-type": "application/json"}


def test_keys_name_every_requests_tenant_and_the_engines_count_each_tenants_service(tmp_path, tiny_model):
    repo = write_test_repository(tmp_path / "repo", cpu_engines=1)
    keys = tmp_path / "keys"
    keys.write_text(KEYS)
    stack = serve_stack(repo, "--keys-file", str(keys))
    try:
        generate = stack.url(GENERATE)
        assert http("POST", generate, generate_body())[0] == 401
        assert http("POST", generate, generate_body(), bearer("sk-not-a-key-000000"))[0] == 401
        assert http("POST", generate, generate_body(), bearer(KEY_A))[0] == 200
        status, _, answer = http(
            "POST", generate, generate_body(), {**bearer(KEY_A), "preble-tenant": "team-c"}
        )
        assert status == 403 and b"only a gateway's key names tenants" in answer, answer
        # a request parameter naming another tenant is written over with the key's own
        body = json.dumps({"text_input": "Hi", "parameters": {"max_tokens": 3, "preble_tenant": "team-z"}})
        assert http("POST", generate, body.encode(), bearer(KEY_A))[0] == 200
        assert (
            http("POST", generate, generate_body(), {**bearer(KEY_GW), "preble-tenant": "walk-in"})[0] == 200
        )
        completions = stack.url("/v1/completions", stack.openai_port)
        ask = json.dumps({"model": "preble", "prompt": "Hello", "max_tokens": 3}).encode()
        assert http("POST", completions, ask, bearer(KEY_C))[0] == 200
        grpc = f"127.0.0.1:{stack.ports.grpc}"
        assert PrebleClient(grpc_url=grpc, api_key=KEY_B).stream_grpc("Hello", {"max_tokens": 3}).text
        with pytest.raises(PrebleError, match="needs a valid API key"):
            PrebleClient(grpc_url=grpc, api_key="sk-not-a-key-000000").stream_grpc("Hello", {"max_tokens": 2})

        # team-b's cap is one request in flight: a second, while its first streams, is 429
        stream = stack.url("/v2/models/preble/generate_stream")
        params = json.dumps({"max_tokens": 3000, "ignore_eos": True})
        long = json.dumps({"text_input": "Hello", "stream": True, "sampling_parameters": params}).encode()
        first = urllib.request.urlopen(urllib.request.Request(stream, long, bearer(KEY_B)), timeout=60)
        try:
            assert first.readline().startswith(b"data: ")
            status, headers, answer = http("POST", generate, generate_body(), bearer(KEY_B))
            assert status == 429 and headers.get("retry-after") == "1" and b"max_in_flight=1" in answer, (
                answer
            )
            assert http("POST", generate, generate_body(), bearer(KEY_A))[0] == 200  # others go on
        finally:
            first.close()
        wait_for(lambda: http("POST", generate, generate_body(), bearer(KEY_B))[0] == 200, 60,
                 "team-b's slot coming back once its stream ended")  # fmt: skip

        # team-d's tokens_per_minute is 10: one answer of 16 tokens spends a minute's worth
        assert http("POST", generate, generate_body(max_tokens=16, ignore_eos=True), bearer(KEY_D))[0] == 200
        status, headers, answer = http("POST", generate, generate_body(), bearer(KEY_D))
        assert status == 429 and int(headers["retry-after"]) > 1 and b"tokens_per_minute=10" in answer, answer
        status, headers, answer = http("POST", completions, ask, bearer(KEY_D))
        assert status == 429 and json.loads(answer)["error"]["type"] == "rate_limit_exceeded", answer
        assert http("POST", generate, generate_body(), bearer(KEY_A))[0] == 200  # nobody else is held back

        metrics = f"http://127.0.0.1:{stack.ports.metrics}"
        served = {}

        def all_counted() -> bool:
            for tenant in ("team-a", "team-b", "team-c", "walk-in"):
                served[tenant] = metric_value(
                    metrics, "preble_tenant_service_tokens_total", f'tenant="{tenant}"'
                )
            return all(served.values())

        wait_for(all_counted, 30, "every tenant's service counted by the engine")
        assert metric_value(metrics, "preble_tenant_service_tokens_total", 'tenant="team-z"') is None
        assert metric_value(metrics, "preble_tenant_service_tokens_total", 'tenant="default"') is None
        assert metric_value(metrics, "preble_tenant_fairness_index") is not None
        wait_for(lambda: metric_value(metrics, "preble_router_tenant_in_flight", 'tenant="team-a"') == 0, 10,
                 "team-a's requests all answered in the router's gauge")  # fmt: skip
    finally:
        out, err = stack.stop()
    assert stack.process.returncode == 0, err


def test_a_bad_keys_file_is_refused_at_start_naming_its_line(tmp_path):
    keys = tmp_path / "keys"
    keys.write_text(f"{KEY_A} team-a 1\n\n{KEY_B} team-b 0\n")
    serve = [sys.executable, "-m", "preble_backend.cli", "serve", "--model-repository", str(tmp_path)]
    done = subprocess.run([*serve, "--keys-file", str(keys)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 1 and f"keys file {keys}, line 3: the weight" in done.stderr, done.stderr
    keys.write_text(f"{KEY_A} team-a\n")
    both = [*serve, "--keys-file", str(keys), "--api-key", "s3cret-s3cret"]
    done = subprocess.run(both, capture_output=True, text=True, timeout=120)
    assert done.returncode == 1 and "not both" in done.stderr, done.stderr


def test_a_restarted_router_has_every_tenants_service_back_from_the_engines(tmp_path, tiny_model):
    """The counts live in the engines: the router's tritonserver SIGKILLed and restarted by
    ``preble serve`` has each tenant's service back (its admin ``status``) from its first
    probes, no lower than before, without a request of either tenant since."""
    repo = write_test_repository(tmp_path / "repo", cpu_engines=1)
    keys = tmp_path / "keys"
    keys.write_text(KEYS)
    stack = serve_stack(repo, "--keys-file", str(keys))
    try:
        admin_key = next(Path(line.rsplit(" in ", 1)[1].strip()).read_text().strip()
                         for line in stack.lines if "admin key" in line)  # fmt: skip
        client = PrebleClient(grpc_url=f"127.0.0.1:{stack.ports.grpc}", api_key=KEY_A)

        def served() -> dict[str, float]:
            try:
                return client.admin("status", admin_key, timeout=10).get("tenants", {})
            except PrebleError:  # the router is not back yet
                return {}

        for key in (KEY_A, KEY_A, KEY_C):
            assert http("POST", stack.url(GENERATE), generate_body(max_tokens=8), bearer(key))[0] == 200
        wait_for(lambda: {"team-a", "team-c"} <= set(served()) and served()["team-a"] > served()["team-c"],
                 30, "the router's copy of both tenants' service")  # fmt: skip
        before = served()
        router = stack.router_server()
        os.kill(router, signal.SIGKILL)

        def restarted() -> bool:
            try:
                return stack.router_server() != router and bool(served())
            except StopIteration:  # between the old server and the new one
                return False

        wait_for(restarted, 120, "the router restarted")
        wait_for(lambda: all(served().get(t, 0) >= before[t] for t in before), 30,
                 "the restarted router's copy of every tenant's service")  # fmt: skip
        assert served()["team-a"] >= before["team-a"] > 0 and served()["team-c"] >= before["team-c"] > 0
    finally:
        stack.stop()
