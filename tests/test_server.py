"""A real tritonserver with the router and two CPU engines, driven by real clients."""

from __future__ import annotations

import json
import re
import time
import urllib.request
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
from server_utils import (
    assert_engine_pages_free,
    client_for,
    launch,
    wait_idle,
    write_test_repository,
)

from client.bench import StackCPU
from client.triton_client import PrebleError
from preble_backend.common.procfs import cpu_seconds, process_role, process_tree

pytestmark = pytest.mark.server
ENGINES = ("preble_engine_0", "preble_engine_1")
GREEDY = {"temperature": 0, "max_tokens": 12}
PROMPT = "The router sends each request to the engine that caches its prefix."


@pytest.fixture(scope="module")
def server(tmp_path_factory, tiny_model):
    root = tmp_path_factory.mktemp("triton")
    # 1 MiB: Triton 2.51's HTTP frontend itself crashes on JSON bodies of about 4 MiB
    # 4 tokens per response (no time rule): every answer here also checks that coalesced
    # responses lose nothing
    repo = write_test_repository(
        root / "repo",
        router_overrides={"max_input_bytes": 1 << 20},
        stream_interval=4,
        stream_interval_ms=60_000,
    )
    srv = launch(repo, root / "server.log")
    yield srv
    try:  # after the whole module: every engine has every page back
        client = client_for(srv)
        for engine in ENGINES:
            assert_engine_pages_free(client, engine)
    finally:
        srv.stop()


@pytest.fixture(scope="module")
def client(server):
    return client_for(server)


@pytest.fixture(scope="module")
def direct_text(tiny_model):
    """What the engine itself produces for PROMPT, decoded: the answer every path must give."""
    from transformers import AutoTokenizer

    from preble_backend.engine.config import EngineConfig
    from preble_backend.engine.engine import Engine

    tok = AutoTokenizer.from_pretrained(tiny_model)
    engine = Engine(EngineConfig(model_path=tiny_model))
    [ids] = engine.generate([tok(PROMPT).input_ids], GREEDY)
    return tok.decode(ids, skip_special_tokens=True)


def test_http_generate_stream_and_grpc_agree_with_the_engine(client, direct_text):
    whole = client.generate(PROMPT, GREEDY, exclude_input_in_output=True, return_finish_reason=True,
                            return_num_input_tokens=True, return_num_output_tokens=True)  # fmt: skip
    assert whole["text_output"] == direct_text
    assert whole["finish_reason"] == "length" and whole["num_output_tokens"] == 12
    assert whole["num_input_tokens"] > 0
    events = list(client.generate_stream(PROMPT, GREEDY))
    assert "".join(e["text_output"] for e in events) == direct_text
    assert len(events) > 1 and events[-1]["instance"] in ENGINES
    grpc = client.stream_grpc(PROMPT, GREEDY, return_finish_reason=True)
    assert grpc.text == direct_text
    assert grpc.final["finish_reason"] == "length"
    # Without exclude_input_in_output a non-streaming answer repeats the prompt (vLLM backend).
    assert client.generate(PROMPT, GREEDY)["text_output"] == PROMPT + direct_text


def test_engines_stream_interval_tokens_per_response(client, direct_text):
    """The engines here send 4 tokens per response after the first (``stream_interval``):
    12 tokens reach the client in at most 4 events (1 + 4 + 4 + 3; more at once when the
    response thread was behind), as the engine's text."""
    events = list(client.generate_stream(PROMPT, GREEDY, return_num_output_tokens=True))
    assert "".join(e["text_output"] for e in events) == direct_text
    assert sum(e["num_output_tokens"] for e in events) == 12
    assert 1 < len(events) <= 4


def test_bench_reads_each_stack_process_cpu(client):
    """``preble bench``'s CPU accounting finds the router's and both engines' stubs and
    tritonserver, and sees the router spend CPU on requests."""
    cpu = StackCPU()
    for _ in range(4):
        client.generate(PROMPT, GREEDY)
    spent = cpu.spent()
    assert {"tritonserver", "stub:preble", *(f"stub:{e}" for e in ENGINES)} <= set(spent), spent
    assert spent["stub:preble"] > 0


def test_logprobs_and_cumulative_logprob_as_the_vllm_backend_returns_them(client, direct_text):
    """Sampling parameters given as strings (as genai-perf sends them), logprobs of the
    sampled tokens and two alternatives each, streamed over SSE and summed."""
    params = {"temperature": "0", "max_tokens": "12", "logprobs": "2"}
    flags = {"return_logprobs": True, "return_cumulative_logprob": True}
    events = list(client.generate_stream(PROMPT, params, **flags))
    assert "".join(e["text_output"] for e in events) == direct_text
    steps = [step for e in events for step in json.loads(e["logprobs"])]
    assert len(steps) == 12 and all(2 <= len(step) <= 3 for step in steps)
    sampled = [next(iter(step.values())) for step in steps]  # the sampled token comes first
    assert all(v["rank"] == 1 and v["logprob"] <= 0 for v in sampled)  # greedy: the likeliest
    assert "".join(v["decoded_token"] for v in sampled) == direct_text
    assert events[-1]["cumulative_logprob"] == pytest.approx(sum(v["logprob"] for v in sampled), rel=1e-5)
    plain = client.generate(PROMPT, GREEDY, exclude_input_in_output=True, return_logprobs=True)
    assert plain["logprobs"] == "null"  # the sampling parameters did not ask for them


def test_stop_string_ends_the_text_before_it(client, direct_text):
    stop = direct_text[len(direct_text) // 2 :][:3]
    answer = client.generate(PROMPT, {**GREEDY, "stop": [stop]}, exclude_input_in_output=True,
                             return_finish_reason=True)  # fmt: skip
    assert answer["text_output"] == direct_text[: direct_text.index(stop)]
    assert answer["finish_reason"] == "stop"
    streamed = "".join(e["text_output"] for e in client.generate_stream(PROMPT, {**GREEDY, "stop": [stop]}))
    assert streamed == answer["text_output"]


def test_unrelated_prompts_are_explored_across_both_engines(client):
    """E2 explores prompts that share nothing by load cost: with requests in flight, the
    batch an engine already runs outweighs a cheaper prefill there, so 16 requests sent 8 at
    a time reach both engines. (Sent one at a time, both engines are idle at every decision,
    and E2 rightly sends each to the engine its learnt fit prices cheapest.)"""
    words = "weather Paris kitchen robot video frame scene stock price route river bridge".split()
    prompts = [" ".join(words[(i + k) % len(words)] for k in range(i % 5 + 3)) * 6 for i in range(16)]
    with ThreadPoolExecutor(8) as pool:
        counts = Counter(a["instance"] for a in pool.map(lambda p: client.generate(p, GREEDY), prompts))
    assert set(counts) == set(ENGINES), counts


def test_e2_exploits_the_engine_that_caches_the_shared_prefix(client):
    shared = " ".join(f"tool_{i}(query)" for i in range(60))
    answers = [client.generate(f"{shared} question {i}", {"max_tokens": 2}) for i in range(4)]
    # The first request is explored; the rest share 95% of its prompt, so E2 sends them
    # to the engine that now caches it, and they hit that engine's prefix cache.
    assert len({a["instance"] for a in answers}) == 1
    assert [a["num_cached_tokens"] > 0 for a in answers] == [False, True, True, True]


def test_cancelled_stream_frees_its_pages(client):
    before = {e: client.engine_control(e, "stats")["load"]["requests_finished"] for e in ENGINES}
    params = {"max_tokens": 3000, "ignore_eos": True, "temperature": 0}
    result = client.stream_grpc(PROMPT, params, cancel_after=3)
    assert len(result.responses) == 3
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        loads = {e: client.engine_control(e, "stats")["load"] for e in ENGINES}
        if sum(v["requests_finished"] - before[e] for e, v in loads.items()) == 1:
            break
        time.sleep(0.1)
    for load in loads.values():
        assert load["running"] == 0, load
        assert load["kv_pages_used"] == load["kv_pages_cached"], load  # no private page left
    assert sum(v["requests_finished"] - before[e] for e, v in loads.items()) == 1


LONG_PROMPT = " ".join(["cache"] * 5000)

BAD_HTTP = [
    ({}, "missing required input 'text_input'"),
    ({"text_input": ""}, "input 'text_input' is empty"),
    ({"text_input": 5}, "attempt to access JSON non-string as string"),
    ({"text_input": ["a", "b"]}, "input 'text_input'"),
    ({"text_input": "hi", "sampling_parameters": "{max_tokens"}, "sampling_parameters is not valid JSON"),
    ({"text_input": "hi", "sampling_parameters": "[1]"}, "sampling_parameters must be a JSON object"),
    ({"text_input": "hi", "sampling_parameters": '{"beam": 2}'}, "unknown sampling parameter(s): beam"),
    ({"text_input": "hi", "parameters": {"foo": 1}}, "unknown sampling parameter(s): foo"),
    ({"text_input": "hi", "sampling_parameters": '{"max_tokens": "8x"}'}, "max_tokens must be an integer"),
    ({"text_input": "hi", "sampling_parameters": '{"seed": 1.5}'}, "seed must be an integer"),
    ({"text_input": "hi", "sampling_parameters": '{"stop": 5}'}, "stop must be a string or list of strings"),
    ({"text_input": "hi", "sampling_parameters": '{"max_tokens": 0}'}, "max_tokens must be >= 1"),
    ({"text_input": "hi", "sampling_parameters": '{"max_tokens": -1}'}, "max_tokens must be >= 1"),
    (
        {"text_input": "hi", "sampling_parameters": '{"max_tokens": 1000000000}'},
        "over the model's context length",
    ),
    ({"text_input": LONG_PROMPT}, "over the model's context length of 4096"),
    ({"text_input": "hi", "sampling_parameters": '{"temperature": -1}'}, "temperature must be a finite"),
    ({"text_input": "hi", "sampling_parameters": '{"temperature": NaN}'}, "temperature must be a finite"),
    ({"text_input": "hi", "sampling_parameters": '{"temperature": Infinity}'}, "must be a finite"),
    ({"text_input": "hi", "sampling_parameters": '{"top_p": NaN}'}, "top_p must be in (0, 1]"),
    ({"text_input": "hi", "sampling_parameters": '{"top_p": -Infinity}'}, "top_p must be in (0, 1]"),
    ({"text_input": "hi", "sampling_parameters": '{"seed": 18446744073709551616}'}, "seed must be a 64-bit"),
    ({"text_input": "hi", "sampling_parameters": "[" * 100_000}, "not valid JSON: nested too deeply"),
    ({"text_input": "x" * (2 << 20)}, "more than the router's max_input_bytes=1048576"),
    ({"text_input": "hi", "sampling_parameters": '{"top_p": 0}'}, "top_p must be in (0, 1]"),
    ({"text_input": "hi", "sampling_parameters": '{"top_p": 1.5}'}, "top_p must be in (0, 1]"),
    ({"text_input": "hi", "sampling_parameters": '{"top_k": 0}'}, "top_k must be -1 (off) or >= 1"),
    (
        {"text_input": "hi", "sampling_parameters": '{"min_tokens": 5, "max_tokens": 2}'},
        "min_tokens must be in",
    ),
    (
        {"text_input": "hi", "stream": True, "exclude_input_in_output": False},
        "exclude_input_in_output = false",
    ),
    ({"text_input": "hi", "stream": "yes"}, "attempt to access JSON non-boolean as boolean"),
]

BAD_GRPC = [
    ({"text_input": np.array([b"\xff\xfe"], dtype=np.object_)}, "input 'text_input' is not valid UTF-8"),
    ({"text_input": np.array([b"x" * (5 << 20)], dtype=np.object_)}, "more than the router's max_input"),
    ({"text_input": np.array([1], dtype=np.int32)}, "input 'text_input' data-type is 'INT32'"),
    ({"text_input": np.array([[b"hi"]], dtype=np.object_)}, "unexpected shape for input 'text_input'"),
    ({"text_input": np.array([b"one", b"two"], dtype=np.object_)}, "unexpected shape for input 'text_input'"),
    ({"text_input": np.array([b"hi"], dtype=np.object_), "stream": np.array([1], dtype=np.int32)},
     "input 'stream' data-type is 'INT32'"),
]  # fmt: skip


@pytest.mark.parametrize("body, message", BAD_HTTP, ids=[m for _, m in BAD_HTTP])
def test_bad_http_input_is_named_and_the_next_request_succeeds(client, body, message):
    with pytest.raises(PrebleError) as err:
        client.generate_raw(body)
    assert message in str(err.value)
    assert client.generate("still serving", {"max_tokens": 3})["text_output"].startswith("still serving")


@pytest.mark.parametrize("inputs, message", BAD_GRPC, ids=[m for _, m in BAD_GRPC])
def test_bad_grpc_input_is_named_and_the_next_request_succeeds(client, inputs, message):
    with pytest.raises(PrebleError) as err:
        client.infer_grpc(inputs)
    assert message in str(err.value)
    assert client.stream_grpc("still serving", {"max_tokens": 3}).final["instance"] in ENGINES


def test_bad_input_loses_no_page(client):
    for engine in ENGINES:
        load = wait_idle(client, engine)
        assert load["kv_pages_used"] == load["kv_pages_cached"], load


def _metrics_text(server) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{server.ports.metrics}/metrics", timeout=10) as r:
        return r.read().decode()


def _series(text: str, name: str) -> list[tuple[str, float]]:
    """(labels, value) of every sample of ``name``."""
    found = re.findall(rf"^{name}{{([^}}]*)}} (\S+)$", text, re.M)
    return [(labels, float(value)) for labels, value in found]


def test_metrics_report_engines_and_routing(server, client):
    for _ in range(2):
        client.generate(PROMPT, {"max_tokens": 2})
    time.sleep(0.5)  # the engines publish their gauges and counters every 100 ms
    text = _metrics_text(server)
    for engine in ENGINES:
        for name in ("kv_pages_used", "kv_pages_free", "waiting_requests", "running_requests",
                     "prompt_tokens_computed_total", "prompt_tokens_cached_total"):  # fmt: skip
            assert f'preble_engine_{name}{{model="{engine}",pid="' in text, name
    decisions = _series(text, "preble_router_decisions_total")
    assert sum(v for _, v in decisions) >= 2
    assert all('policy="e2"' in labels and 'tenant="default"' in labels for labels, _ in decisions)
    assert any('branch="explore"' in labels for labels, _ in decisions)
    # Per request, labelled by policy, engine and tenant: the latencies vLLM exposes and token counts.
    per_request = (
        "e2e_request_latency_seconds",
        "time_to_first_token_seconds",
        "time_per_output_token_seconds",
        "request_prompt_tokens",
        "request_generation_tokens",
    )
    for name in per_request:
        counts = _series(text, f"preble_router_{name}_count")
        assert sum(v for _, v in counts) >= 2
        assert all('policy="e2"' in labels and "engine=" in labels for labels, _ in counts)
        assert all('tenant="default"' in labels for labels, _ in counts)  # no keys file: one tenant
    prompt = sum(v for _, v in _series(text, "preble_router_prompt_tokens_total"))
    cached = sum(v for _, v in _series(text, "preble_router_cached_prompt_tokens_total"))
    assert prompt >= 2 * len(PROMPT.split()) and 0 < cached < prompt  # the second request hit the cache
    for name in ("request_queue_time_seconds", "time_to_first_token_seconds"):  # the engines', by tenant
        counts = _series(text, f"preble_engine_{name}_count")
        assert sum(v for _, v in counts) >= 2 and all('tenant="default"' in labels for labels, _ in counts)


def test_every_metric_the_grafana_dashboard_queries_exists(server, client):
    client.generate(PROMPT, {"max_tokens": 2})
    with pytest.raises(PrebleError):
        client.generate(PROMPT, {"max_tokens": 0})  # a failure: its counter moves
    time.sleep(0.5)
    text = _metrics_text(server)
    dashboard = json.loads((Path(__file__).parent.parent / "docs/grafana/preble_dashboard.json").read_text())
    exprs = [target["expr"] for panel in dashboard["panels"] for target in panel["targets"]]
    names = {re.sub(r"_(bucket|sum|count)$", "", n) for e in exprs for n in re.findall(r"\bpreble_\w+", e)}
    assert len(names) >= 15
    for name in sorted(names):
        assert re.search(rf"^{name}(_bucket|_sum|_count)?{{", text, re.M), f"{name} is not on /metrics"
    failures = _series(text, "preble_router_failures_total")
    assert any('reason="invalid"' in labels and value >= 1 for labels, value in failures), failures
    assert all("engine=" in labels for labels, _ in failures), failures  # "none": refused before routing


def test_router_in_another_server_reaches_these_engines(server, client, tmp_path, direct_text):
    remote = f"grpc://127.0.0.1:{server.ports.grpc}/preble_engine_1"
    repo = write_test_repository(tmp_path / "front", cpu_engines=0, remote_engines=[remote])
    front = launch(repo, tmp_path / "front.log")
    try:
        answer = client_for(front).generate(PROMPT, GREEDY, exclude_input_in_output=True)
        assert answer["text_output"] == direct_text
        assert answer["instance"] == remote
        streamed = client_for(front).stream_grpc(PROMPT, GREEDY)
        assert streamed.text == direct_text
    finally:
        front.stop()


def test_perf_analyzer_as_typed_streaming_run_has_no_errors(server):
    """The venv's perf_analyzer with no LD_LIBRARY_PATH: make setup set its run path."""
    import os

    import tritonclient.grpc as grpcclient

    from client.perf_analyzer import run

    def counts() -> tuple[int, int]:
        with grpcclient.InferenceServerClient(f"127.0.0.1:{server.ports.grpc}") as c:
            stats = c.get_inference_statistics("preble", as_json=True)["model_stats"][0]["inference_stats"]
        return int(stats["success"].get("count", 0)), int(stats["fail"].get("count", 0))

    before = counts()
    typed = {k: v for k, v in os.environ.items() if k != "LD_LIBRARY_PATH"}
    result = run(
        f"127.0.0.1:{server.ports.grpc}", concurrency=2, request_count=16, num_prompts=8, max_tokens=8,
        env=typed,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-2000:]
    assert "Request count: 16" in result.stdout
    assert "error" not in (result.stdout + result.stderr).lower()
    # The server's own counters, polled: perf_analyzer's server window closes when the last
    # final response arrives, and Triton can record that request's statistics after it
    deadline = time.monotonic() + 30
    while (after := counts()) != (before[0] + 16, before[1]) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert after == (before[0] + 16, before[1]), f"success/fail {before} -> {after}"


def test_engine_refuses_a_control_op_sent_with_input_ids(client):
    inputs = {
        "control": np.array([b'{"op": "stats"}'], dtype=np.object_),
        "input_ids": np.array([5, 6, 7], dtype=np.int32),
    }
    with pytest.raises(PrebleError, match="'control' cannot be sent together with 'input_ids'"):
        client.infer_grpc(inputs, model=ENGINES[0])
    assert client.engine_control(ENGINES[0], "stats")["load"]["kv_pages_total"] > 0


def test_two_router_processes_share_the_requests(tmp_path, direct_text):
    """``preble repo --router-instances 2``: Triton spreads concurrent requests over two
    router stubs, each with its own tree and engine streams; every answer is the engine's."""
    srv = launch(write_test_repository(tmp_path / "repo", router_instances=2), tmp_path / "server.log")
    try:
        routers = [pid for pid in process_tree(srv.process.pid) if process_role(pid) == "stub:preble"]
        assert len(routers) == 2
        client = client_for(srv)
        ask = lambda _: client.generate(PROMPT, GREEDY, exclude_input_in_output=True)["text_output"]  # noqa: E731
        spent = lambda since: {pid: cpu_seconds(pid) - since[pid] for pid in routers}  # noqa: E731
        before, start = {pid: cpu_seconds(pid) for pid in routers}, time.monotonic()
        with ThreadPoolExecutor(8) as pool:
            assert list(pool.map(ask, range(96))) == [direct_text] * 96
        burst, took = spent(before), time.monotonic() - start
        before = {pid: cpu_seconds(pid) for pid in routers}
        time.sleep(took)
        idle = spent(before)
        # each served some: a stub costs ~4 ms of CPU per request, so a stub that served
        # a dozen of the 96 spends 50 ms more than it does idle for as long
        assert all(burst[pid] > idle[pid] + 0.05 for pid in routers), (burst, idle)
        for engine in ENGINES:
            assert_engine_pages_free(client, engine)
    finally:
        srv.stop()
