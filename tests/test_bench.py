"""``preble bench`` against a real tritonserver: two emulated engines behind the router,
two policies switched by the router's admin control request, every request answered, the JSON
and the plot written. The numbers live in docs/BENCHMARKS.md, not in assertions."""

from __future__ import annotations

import asyncio
import json
import time

import pytest
from server_utils import assert_engine_pages_free, client_for, launch, serve_stack, write_test_repository
from tqdm import tqdm

from preble_backend.cli import main

pytestmark = pytest.mark.server


def test_bench_replays_a_workload_for_each_policy(tmp_path, tiny_model, capsys):
    repo = write_test_repository(tmp_path / "repo", compute="emulated", cost_model="mistral7b_a6000",
                                 max_num_tokens=65536)  # fmt: skip
    server = launch(repo, tmp_path / "server.log")
    try:
        url = f"127.0.0.1:{server.ports.grpc}"
        # no --tokenizer: prompts are sized in the served model's tokens (the simulator's
        # run below, given the same model's tokenizer, sees the same prompt tokens)
        code = main(["bench", "--url", url, "--workload", "toolbench", "--requests", "24", "--rates", "6,12",
                     "--policies", "e2,round_robin", "--scale", "0.2",
                     "--output", str(tmp_path / "out"), "--admin-key", server.access.admin_key])  # fmt: skip
        assert code == 0
        assert "prompts sized in the served model's tokens" in capsys.readouterr().out
        report = json.loads((tmp_path / "out" / "bench_toolbench.json").read_text())
        runs = report["runs"]
        assert [(r["policy"], r["rps"]) for r in runs] == [
            ("e2", 6.0), ("round_robin", 6.0), ("e2", 12.0), ("round_robin", 12.0)
        ]  # fmt: skip
        for run in runs:
            assert run["completed"] == run["num_requests"] == 24 and not run["errors"]
            assert sum(run["per_engine"].values()) == 24
            assert 0 < run["avg_latency_s"] <= run["p99_latency_s"]
            assert 0 <= run["cache_hit_ratio"] < 1 and run["prompt_tokens"] > 0
        assert set(runs[1]["per_engine"].values()) == {12}  # round-robin alternates
        assert (tmp_path / "out" / "bench_toolbench.png").stat().st_size > 10_000
        # The same requests through the simulator: same prompts, tokenized as the router does.
        code = main(["bench", "--simulate", "2", "--capacity-tokens", "65536", "--workload", "toolbench",
                     "--requests", "24", "--rates", "6,12", "--policies", "e2,round_robin", "--scale", "0.2",
                     "--tokenizer", tiny_model, "--output", str(tmp_path / "sim")])  # fmt: skip
        assert code == 0
        sim = json.loads((tmp_path / "sim" / "bench_toolbench.json").read_text())["runs"]
        references = [r for r in sim if r["policy"] in ("reference", "lower_bound")]
        expected = [(p, rps) for p in ("lower_bound", "reference") for rps in (6.0, 12.0)]
        assert sorted((r["policy"], r["rps"]) for r in references) == expected
        sim = [r for r in sim if r not in references]
        assert all(r["avg_latency_s_over_reference"] > 0 for r in sim)
        assert [(r["policy"], r["rps"]) for r in sim] == [(r["policy"], r["rps"]) for r in runs]
        assert [r["prompt_tokens"] for r in sim] == [r["prompt_tokens"] for r in runs]
        assert set(sim[1]["per_engine"].values()) == {12} and sim[0]["completed"] == 24
        # Over HTTP server-sent events, and straight to one engine ("direct", token ids):
        # the same prompts reach the engines as the same tokens either way.
        code = main(["bench", "--url", url, "--http-url", f"127.0.0.1:{server.ports.http}", "--transport",
                     "sse", "--workload", "toolbench", "--requests", "12", "--rates", "6", "--policies",
                     "round_robin", "--direct", "preble_engine_0", "--scale", "0.2", "--tokenizer",
                     tiny_model, "--output", str(tmp_path / "sse"),
                     "--admin-key", server.access.admin_key])  # fmt: skip
        assert code == 0
        sse, direct = json.loads((tmp_path / "sse" / "bench_toolbench.json").read_text())["runs"]
        assert (sse["policy"], direct["policy"]) == ("round_robin", "direct")
        for run in (sse, direct):
            assert run["completed"] == 12 and not run["errors"]
            assert 0 < run["avg_ttft_s"] < run["avg_latency_s"]
        assert direct["per_engine"] == {"preble_engine_0": 12} and set(sse["per_engine"].values()) == {6}
        assert direct["prompt_tokens"] == sse["prompt_tokens"] > 0
        assert direct["output_tokens"] == sse["output_tokens"] > 0
        assert server.process.poll() is None  # six policy switches
        client = client_for(server)
        for engine in ("preble_engine_0", "preble_engine_1"):
            assert_engine_pages_free(client, engine)
    finally:
        server.stop()


def test_bench_runs_against_the_server_preble_serve_starts(tmp_path, tiny_model, capsys):
    """The default ``preble serve`` (no option for bench's sake): bench switches policies
    with the admin key serve left for its port, and every request is answered."""
    repo = write_test_repository(tmp_path / "repo", compute="emulated", cost_model="mistral7b_a6000",
                                 max_num_tokens=65536)  # fmt: skip
    stack = serve_stack(repo)
    try:
        code = main(["bench", "--url", f"127.0.0.1:{stack.ports.grpc}", "--workload", "toolbench",
                     "--requests", "12", "--rates", "8", "--policies", "round_robin,e2", "--scale", "0.1",
                     "--output", str(tmp_path / "out")])  # fmt: skip
        assert code == 0
        runs = json.loads((tmp_path / "out" / "bench_toolbench.json").read_text())["runs"]
        assert [r["policy"] for r in runs] == ["round_robin", "e2"]
        assert all(r["completed"] == 12 and not r["errors"] for r in runs)
        assert set(runs[0]["per_engine"].values()) == {6}  # round robin: the switch took
        # Its engines run on servers of their own: --direct is refused by name, before any run.
        code = main(["bench", "--url", f"127.0.0.1:{stack.ports.grpc}", "--workload", "toolbench",
                     "--requests", "12", "--rates", "8", "--policies", "round_robin", "--scale", "0.1",
                     "--direct", "preble_engine_0", "--tokenizer", tiny_model,
                     "--output", str(tmp_path / "direct")])  # fmt: skip
        assert code != 0 and not (tmp_path / "direct").exists()
        err = capsys.readouterr().err
        assert "--direct preble_engine_0: the server at 127.0.0.1:" in err
        assert "tritonserver of its own" in err
    finally:
        stack.stop()


class _Silent:
    """A transport whose server answers requests of one token and then falls silent."""

    async def __call__(self, req, out, start):
        if req.max_tokens == 1:
            out.output_tokens, out.first_token, out.finished = 1, 0.001, 0.002
            return
        await asyncio.sleep(3600)  # a stream that is never answered

    async def close(self):
        pass


def test_a_server_that_falls_silent_ends_the_run_with_the_reason():
    from client.bench import BenchRequest, _replay

    requests = [BenchRequest(0.0, "a", 1), BenchRequest(0.0, "b", 5), BenchRequest(0.05, "c", 5)]
    began = time.monotonic()
    outcomes = asyncio.run(_replay(_Silent, requests, 600.0, 0.5, tqdm(disable=True)))
    assert time.monotonic() - began < 5  # not the 600 s request timeout
    assert outcomes[0].error is None and outcomes[0].finished
    assert outcomes[1].error == outcomes[2].error == "no answer for 0.5 s with 2 requests open"


class _Timed:
    """A transport that answers every request after 0.2 s and records when each was sent."""

    def __init__(self):
        self.sent: dict[str, float] = {}

    async def __call__(self, req, out, start):
        self.sent[req.prompt] = time.monotonic() - start
        await asyncio.sleep(0.2)
        out.output_tokens, out.first_token, out.finished = 1, out.sent + 0.1, out.sent + 0.2

    async def close(self):
        pass


def test_a_conversation_is_played_closed_loop():
    """A chat turn is sent think_s after the answer it follows, not at a time fixed in
    advance: the second turn 0.2 s (the first's answer) + 0.3 s after the first, the third
    0.2 + 0.1 s after the second, while an independent request goes at its own time."""
    from client.bench import BenchRequest, _replay

    transport = _Timed()
    requests = [BenchRequest(0.0, "t1", 4), BenchRequest(0.0, "t2", 4, after=0, think_s=0.3),
                BenchRequest(0.0, "t3", 4, after=1, think_s=0.1), BenchRequest(0.1, "other", 4)]  # fmt: skip
    outcomes = asyncio.run(_replay(lambda: transport, requests, 60.0, 10.0, tqdm(disable=True)))
    assert all(o.error is None for o in outcomes)
    sent = transport.sent
    assert sent["t2"] - sent["t1"] == pytest.approx(0.5, abs=0.05)
    assert sent["t3"] - sent["t2"] == pytest.approx(0.3, abs=0.05)
    assert sent["other"] == pytest.approx(0.1, abs=0.05)


def test_a_runs_failures_are_printed_with_their_reasons():
    from client.bench import summary_line

    record = {"policy": "e2", "rps": 4.0, "avg_latency_s": 1.0, "p99_latency_s": 2.0, "avg_ttft_s": 0.1,
              "cache_hit_ratio": 0.5, "completed": 11, "num_requests": 12, "per_engine": {"a": 11},
              "errors": {"prompt (5000 tokens) plus max_tokens (16) is 5016 tokens, over the model's context "
                         "length of 4096": 1}}  # fmt: skip
    [why] = record["errors"]
    assert summary_line(record).splitlines()[-1] == f"    1 failed: {why}"


def test_the_plot_leaves_room_above_its_top_marker(tmp_path):
    from client.plots import latency_vs_rate

    records = [
        {"policy": p, "rps": 4.0, "avg_latency_s": v, "p99_latency_s": 2 * v}
        for p, v in (("e2", 1.0), ("round_robin", 1.5))
    ]  # one rate: the case that clipped
    (_, avg_top), (_, p99_top) = latency_vs_rate(records, tmp_path / "one.png", "one rate")
    assert avg_top >= 1.12 * 1.5 and p99_top >= 1.12 * 3.0


def test_requests_spread_over_router_replicas_in_turn():
    """``--url A,B``: each request goes to the next router, as a Service spreads them."""
    from client.bench import BenchConfig, Outcome
    from client.bench_transports import Spread

    class Router:
        def __init__(self, name: str) -> None:
            self.name, self.closed = name, False

        async def __call__(self, req, out, start):
            out.instance = self.name

        async def close(self):
            self.closed = True

    async def run():
        spread = Spread([lambda: Router("a"), lambda: Router("b")])
        outs = [Outcome(sent=0.0) for _ in range(5)]
        for out in outs:
            await spread(None, out, 0.0)
        await spread.close()
        return [o.instance for o in outs], [r.closed for r in spread.routers]

    assert asyncio.run(run()) == (["a", "b", "a", "b", "a"], [True, True])
    assert BenchConfig(url="h:1, h:2,").urls == ["h:1", "h:2"]
    with pytest.raises(ValueError, match="several --url routers take --transport grpc"):
        from client.bench import bench

        bench(BenchConfig(url="h:1,h:2", transport="sse"))


def test_the_relay_floor_script_measures_a_python_backend_relay(capsys, monkeypatch):
    from preble_backend.benchmarks import relay_floor

    argv = ["relay_floor", "--rates", "50", "--requests", "20", "--chunks", "2"]
    monkeypatch.setattr("sys.argv", argv)
    relay_floor.main()
    line = capsys.readouterr().out.strip().splitlines()[-1]
    assert line.startswith("rate 50/s, 20 requests: tritonserver + stub ") and "client" in line


def test_tpot_while_a_new_document_arrives_counts_only_requests_decoding_then():
    """Documents a and b; a's later questions and a background prompt are not new documents.
    Request 0 decodes over [1, 5] while b's first request is sent at 3: counted (4 s over 8
    tokens after the first, 0.5 s). Request 1 decodes over [4, 4.5]: nothing new is sent
    then (a's third question at 4.2 is no new document, the background prompt at 4.3 is
    none). Request 3 (b's first) decodes over [3.5, 6]; its own send at 3 is before it."""
    from client.bench import new_group_tpot, summarize
    from client.bench_config import Outcome

    outcomes = [Outcome(sent=0.5, first_token=1.0, finished=5.0, output_tokens=9),
                Outcome(sent=3.9, first_token=4.0, finished=4.5, output_tokens=6),
                Outcome(sent=4.2, first_token=4.6, finished=4.8, output_tokens=3),
                Outcome(sent=3.0, first_token=3.5, finished=6.0, output_tokens=6),
                Outcome(sent=4.3, first_token=4.4, finished=4.9, output_tokens=2)]  # fmt: skip
    groups = ["doc-a", "doc-a", "doc-a", "doc-b", "background"]
    assert new_group_tpot(outcomes, groups) == [0.5]
    record = summarize(outcomes, groups)
    assert record["new_doc_decoding"] == 1 and record["p99_tpot_new_doc_s"] == 0.5
    assert "p99_tpot_new_doc_s" not in summarize(outcomes)
