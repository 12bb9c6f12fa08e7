"""The NVML load view with an injected source, Azure trace replay, mixes, and the
``preble workload`` / ``preble simulate`` commands."""

from __future__ import annotations

import gzip
import io
import json
import re
import sys

import pytest
import torch

from client.azure_trace import azure_trace
from client.workloads import generate, mix, poisson_arrivals
from preble_backend.cli import main
from scheduler.nvml_load import GpuSample, LoadView


def test_load_view_merges_gpu_samples_with_engine_reports():
    calls = []

    def source(gpu: int) -> GpuSample:
        calls.append(gpu)
        return GpuSample(utilization=0.25 * (gpu + 1), memory_used=gpu * 10, memory_total=100)

    view = LoadView([0, None, 2], source=source, interval_s=0.01)
    view.report(1, {"waiting": 3})
    view.sample_once()
    assert calls == [0, 2]  # the remote instance (no local GPU) is not sampled
    assert view.snapshot(0) == {"gpu_utilization": 0.25, "gpu_memory_fraction": 0.0}
    assert view.snapshot(1) == {"waiting": 3}
    assert view.snapshot(2)["gpu_memory_fraction"] == 0.2
    view.start()  # the background thread keeps sampling until stopped
    view.stop()


def test_load_view_without_gpus_never_samples():
    view = LoadView([None, None], source=lambda gpu: (_ for _ in ()).throw(AssertionError("sampled")))
    view.start()
    view.sample_once()
    view.stop()
    assert view.snapshot(0) == {}


def test_load_view_samples_the_gpus_of_engines_on_this_host_by_uuid_first():
    """An engine's report names its device; the view samples a GPU of an engine on this
    host from then on: by the UUID the engine reports (NVML's own name for it) where it
    does, else by its cuda index. A CPU engine, or one on another host, is never sampled."""
    seen = []
    view = LoadView([None] * 5, source=lambda gpu: seen.append(gpu) or GpuSample(0.5, 1, 4), interval_s=60)
    view.learn_gpu(0, {"device": "cuda:3", "gpu_uuid": "GPU-5f2c"}, on_this_host=True)
    view.learn_gpu(1, {"device": "cuda:2"}, on_this_host=True)
    view.learn_gpu(2, {"device": "cuda"}, on_this_host=True)
    view.learn_gpu(3, {"device": "cuda:1", "gpu_uuid": "GPU-77"}, on_this_host=False)
    view.learn_gpu(4, {"device": "cpu"}, on_this_host=True)
    view.learn_gpu(0, {"device": "cuda:0"}, on_this_host=True)  # learnt once: a later report changes nothing
    assert view.gpus == ["GPU-5f2c", 2, 0, None, None]
    view.sample_once()
    view.stop()
    assert seen == ["GPU-5f2c", 2, 0] and view.snapshot(1)["gpu_memory_fraction"] == 0.25
    assert "gpu_utilization" not in view.snapshot(3) and "gpu_utilization" not in view.snapshot(4)


def test_engines_at_loopback_addresses_are_on_this_host():
    """``preble serve`` puts each engine in a tritonserver of its own, reached at 127.0.0.1:
    their GPUs are this host's. An engine at any other address is not."""
    from preble_backend.router.engines.engine_client import LocalEngine, RemoteEngine

    here = ["127.0.0.1:8001", "127.3.4.5:9000", "localhost:8001", "[::1]:8001"]
    elsewhere = ["10.0.0.5:8001", "engines.example:8001", "[2001:db8::1]:8001"]
    assert [RemoteEngine(url, "m").on_this_host for url in here + elsewhere] == [True] * 4 + [False] * 3
    assert LocalEngine.on_this_host


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_an_engine_names_its_gpu_as_nvml_does():
    """The UUID an engine reports is one NVML knows, and the router's sampler reads it."""
    import pynvml

    from preble_backend.engine.runners.model_runner import device_facts
    from scheduler.nvml_load import nvml_source

    read = nvml_source()
    facts = device_facts(torch.device("cuda:0"))
    handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(pynvml.nvmlDeviceGetCount())]
    assert facts["gpu_uuid"] in {pynvml.nvmlDeviceGetUUID(h) for h in handles}
    assert read(facts["gpu_uuid"]).memory_total > 0


def test_azure_trace_replay_keeps_timestamps_and_lengths(tmp_path):
    path = tmp_path / "trace.csv"
    path.write_text(
        "TIMESTAMP,ContextTokens,GeneratedTokens\n"
        "2023-11-16 18:15:46.6805900,374,44\n"
        "2023-11-16 18:15:50.9951690,396,109\n"
        "2023-11-16 18:15:51.0000000,1000,0\n"
    )
    reqs = azure_trace(path, shared_fraction=0.5)
    assert [r.prompt_len for r in reqs] == [374, 396, 1000]
    assert [r.output_len for r in reqs] == [44, 109, 1]
    assert reqs[0].arrival == 0.0 and abs(reqs[1].arrival - 4.314579) < 1e-3
    assert reqs[0].segments[0].length == 187  # the synthesized shared prefix


def test_mix_and_poisson_arrivals():
    a, b = generate("toolbench", 30, seed=1), generate("videoqa", 10, seed=1)
    mixed = poisson_arrivals(mix([(a, 3.0), (b, 1.0)], seed=2), rps=5.0, seed=2)
    assert len(mixed) == 40 and sorted(id(r) for r in mixed) == sorted(id(r) for r in a + b)
    gaps = [y.arrival - x.arrival for x, y in zip(mixed, mixed[1:])]
    assert all(g > 0 for g in gaps) and 0.1 < sum(gaps) / len(gaps) < 0.4  # mean 1/5 s


class Terminal(io.StringIO):
    """stderr as a terminal: tqdm draws its bars only there."""

    def isatty(self) -> bool:
        return True


def test_workload_and_simulate_commands(tmp_path, capsys, monkeypatch):
    assert main(["workload", "summarize", "--workload", "videoqa", "--num-requests", "60"]) == 0
    out = capsys.readouterr().out
    assert "| prompt_len |" in out and "(9865, 5976)" in out
    trace = tmp_path / "t.jsonl"
    assert main(["workload", "generate", "--workload", "loogle", "--num-requests", "5", "--scale", "0.01",
                 "--output", str(trace)]) == 0  # fmt: skip
    rows = [json.loads(line) for line in trace.read_text().splitlines()]
    assert len(rows) == 5 and all(r["text_input"] and r["max_tokens"] >= 1 for r in rows)
    monkeypatch.setattr(sys, "stderr", terminal := Terminal())
    assert main(["simulate", "--workload", "toolbench", "--instances", "2", "--requests", "60",
                 "--policies", "e2,round_robin", "--output", str(tmp_path / "sim")]) == 0  # fmt: skip
    bars = terminal.getvalue()  # the stress-rate search, then the runs
    assert "finding the stress rate" in bars and "toolbench x2: 100%" in bars and "run/s" in bars
    records = json.loads(gzip.decompress((tmp_path / "sim" / "toolbench_2.json.gz").read_bytes()))
    assert {r["policy"] for r in records} == {"e2", "round_robin", "reference", "lower_bound"}
    for r in records:  # every run read against perfect placement at its rate; no policy beats the bound
        ref = next(x for x in records if x["policy"] == "reference" and x["rps"] == r["rps"])
        bound = next(x for x in records if x["policy"] == "lower_bound" and x["rps"] == r["rps"])
        assert abs(r["avg_latency_s_over_reference"] - r["avg_latency_s"] / ref["avg_latency_s"]) < 1e-9
        if r["policy"] in ("e2", "round_robin"):  # the pooled reference is no real cluster: N× faster
            assert r["avg_latency_s"] >= bound["avg_latency_s"] * (1 - 1e-9)  # equal when nothing waits
            assert r["p99_latency_s"] >= bound["p99_latency_s"] * (1 - 1e-9)
    for key in ("avg_latency_s", "p99_latency_s", "avg_ttft_s", "p99_ttft_s", "avg_tpot_s", "throughput_rps",
                "cache_hit_ratio", "num_requests", "rps", "instances", "workload"):  # fmt: skip
        assert key in records[0]
    assert (tmp_path / "sim" / "toolbench_2.png").stat().st_size > 10_000


def test_bench_shows_its_progress(tmp_path, monkeypatch, tiny_model):
    """``preble bench --simulate``: tokenizing and each rate's policies as bars."""
    monkeypatch.setattr(sys, "stderr", terminal := Terminal())
    assert main(["bench", "--simulate", "2", "--workload", "toolbench", "--requests", "12", "--rates", "4",
                 "--policies", "e2,round_robin", "--scale", "0.05", "--tokenizer", tiny_model,
                 "--output", str(tmp_path / "b")]) == 0  # fmt: skip
    bars = terminal.getvalue()
    assert "tokenizing: 100%" in bars and "simulating @ 4.0 rps: 100%" in bars


def test_simulate_reports_progress_in_lines_off_a_terminal(tmp_path, monkeypatch):
    """Off a terminal (a log file, CI, a pipe) tqdm's bars draw nothing: long work says up
    front how much there is, then a line as it goes and one at the end."""
    monkeypatch.setattr(sys, "stderr", log := io.StringIO())
    assert main(["simulate", "--workload", "toolbench", "--instances", "2", "--requests", "40",
                 "--policies", "e2,round_robin", "--output", str(tmp_path / "sim")]) == 0  # fmt: skip
    lines = log.getvalue().splitlines()
    assert any(re.fullmatch(r"finding the stress rate: \d+ runs to do", ln) for ln in lines), lines
    assert any(re.fullmatch(r"toolbench x2: \d+ runs to do", ln) for ln in lines), lines
    done = [ln for ln in lines if ln.startswith("toolbench x2: ") and " runs done after " in ln]
    total = re.search(r"(\d+) runs to do", next(ln for ln in lines if ln.startswith("toolbench x2"))).group(1)
    assert done and done[-1].startswith(f"toolbench x2: {total}/{total} runs done after "), lines
    assert "\r" not in log.getvalue()  # no bar was drawn
