"""Benchmark: a prefix served from the host tier against the same prefix recomputed and
the same prefix still on the device, in one engine, in one run.

For each prefix length: a request computes the prefix (cold); the device's cache is
pushed down to the host tier (offload: its copy, timed); the next request with that
prefix loads it back (host); then once more with the prefix still on the device
(device); and the cache is pushed down again (reoffload: the host kept the loaded-back
pages, so nothing is copied). Requests are timed to their first token, alternating
rounds so drift hits all alike, and every answer is checked equal; then the tier's copies
of as many pages alone, both ways (GB/s). Usage (the defaults:
the embedded model on this host):

    python -m preble_backend.benchmarks.host_tier --prefix-lens 1024,4000 --rounds 3
    python -m preble_backend.benchmarks.host_tier --model-path smollm2 --device cuda
    python -m preble_backend.benchmarks.host_tier --model-path 8b-shape --device cuda --dtype bfloat16

``8b-shape``: random weights with Llama-3-8B's layer shape (4 layers, written to a temporary
directory), issue 41's GPU measurement: recompute and load-back both scale per layer, so
their ratio is the full model's.

``--copy-volume WORKLOAD`` instead counts the copies the built tier makes on a simulated
trace, against plain write-back and write-through (``copy_volume``): the measurement
behind keeping a loaded-back page's host copy.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import tempfile
import time
from collections.abc import Callable
from typing import TypeVar

import torch

from preble_backend.engine.cache.host_tier import copy_pages
from preble_backend.engine.config import EngineConfig
from preble_backend.engine.engine import Engine
from preble_backend.model.pypi_models import resolve as resolve_model

GREEDY = {"max_tokens": 1, "temperature": 0, "ignore_eos": True}
T = TypeVar("T")


def timed(engine: Engine, work: Callable[[], T]) -> tuple[float, T]:
    """Seconds ``work`` takes on the engine's device (synchronised on a GPU), and its result."""
    if engine.runner.device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    out = work()
    if engine.runner.device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - start, out


def ttft(engine: Engine, prompt: list[int]) -> tuple[float, list[int]]:
    """Seconds to the first token of ``prompt`` alone on the engine, and that token."""
    seconds, [out] = timed(engine, lambda: engine.generate([prompt], GREEDY))
    return seconds, out


def push_down(engine: Engine) -> float:
    """Seconds to move the device's (idle) cache down to the host tier."""
    return timed(engine, lambda: engine.pool.free(engine.cache.evict(engine.cache.num_evictable_pages)))[0]


def copy_rate(engine: Engine, pages: int, rounds: int) -> dict[str, float]:
    """GB/s of the tier's own copies of ``pages`` free pages, host to device (a load-back's
    copy) and device to host (an offload's), median of ``rounds``: what the TTFTs above
    hold of the copy path, apart from the forward passes."""
    host = engine.cache.host
    device_pages, host_pages = engine.pool.alloc(pages), host.pool.alloc(pages)
    rates = {}
    try:
        for name, args in (("load", (host.pool, host_pages, host.device, device_pages)),
                           ("offload", (host.device, device_pages, host.pool, host_pages))):  # fmt: skip
            seconds = [timed(engine, lambda a=args: copy_pages(*a))[0] for _ in range(rounds)]
            rates[f"{name}_GBps"] = round(pages * host.bytes_per_page / statistics.median(seconds) / 1e9, 2)
    finally:
        engine.pool.free(device_pages)
        host.pool.free(host_pages)
    return rates


def measure(engine: Engine, prefix_len: int, rounds: int, vocab: int) -> dict:
    gen = torch.Generator().manual_seed(prefix_len)
    times: dict[str, list[float]] = {"cold": [], "offload": [], "host": [], "device": [], "reoffload": []}
    answers, pages_loaded = set(), []
    for _ in range(rounds):
        prefix = torch.randint(3, vocab, (prefix_len,), generator=gen).tolist()
        engine.flush_cache()
        seconds, first = ttft(engine, prefix + [5])
        times["cold"].append(seconds)
        times["offload"].append(push_down(engine))
        loaded = engine.stats()["host_pages_loaded"]
        seconds, again = ttft(engine, prefix + [5])
        pages_loaded.append(engine.stats()["host_pages_loaded"] - loaded)
        times["host"].append(seconds)
        seconds, third = ttft(engine, prefix + [5])
        times["device"].append(seconds)
        times["reoffload"].append(push_down(engine))
        answers.add((tuple(first), tuple(again), tuple(third)))
    assert all(a == b == c for a, b, c in answers), "an answer changed between tiers"
    median = {k: statistics.median(v) for k, v in times.items()}
    return {"prefix_len": prefix_len, "pages_loaded_back": min(pages_loaded),
            **{f"{k}_ttft_s": round(median[k], 5) for k in ("cold", "host", "device")},
            **{f"{k}_s": round(median[k], 5) for k in ("offload", "reoffload")},
            "recompute_over_load_back": round(median["cold"] / median["host"], 2),
            "load_back_over_device_hit": round(median["host"] / median["device"], 2),
            "recompute_over_offload": round(median["cold"] / median["offload"], 2),
            **copy_rate(engine, min(pages_loaded), rounds)}  # fmt: skip


def copy_volume(
    workload: str, requests: int, rps: float, device_tokens: int, host_tokens: int, copy_ahead: bool = True
) -> dict:
    """The built tier's copies against the other policies', in the simulator (4 instances
    under E2, the paper's Mistral-7B/A6000 costs): pages copied down (in line, those the
    device evicts whose copy the host had not kept since a load-back, and ahead of their
    eviction, ``copies_ahead``), against those plain
    write-back would copy (every page the device evicts) and write-through would (every
    page the device stores, less those it got back from the host, which it still holds)."""
    from preble_backend.common.cost_model import CostModel
    from scheduler.policies import make_policy
    from scheduler.sim.simulator import SimConfig, metrics, simulate
    from scheduler.sim.sweep import cluster_facts, trace

    cost = CostModel.load("mistral7b_a6000")
    cfg = SimConfig.of(4, device_tokens, host_kv_tokens=host_tokens, host_copy_ahead=copy_ahead)
    stored = [0]

    def factory(clock):
        policy = make_policy("e2", 4, cluster_facts(cfg, cost, clock))
        on_finish = policy.on_finish

        def counting(instance, request, info):
            stored[0] += sum(len(e.hashes) - e.start for e in info.events
                             if e.tier == "device" and e.kind == "stored")  # fmt: skip
            on_finish(instance, request, info)

        policy.on_finish = counting
        return policy

    result = simulate(trace(workload, requests, rps), factory, cfg, cost)
    tiers = [inst.cache.host.stats for inst in result.instances]
    offloaded, loaded = sum(t.pages_offloaded for t in tiers), sum(t.pages_loaded for t in tiers)
    reused, ahead = sum(t.pages_reused for t in tiers), sum(t.pages_copied_ahead for t in tiers)
    return {"workload": workload, "rps": rps, "device_tokens": device_tokens,
            "host_tokens": host_tokens, "pages_stored": stored[0], "copies": offloaded + ahead,
            "copies_ahead": ahead,
            "pages_reused": reused, "write_back_copies": offloaded + reused,
            "write_through_copies": stored[0] - loaded, "pages_loaded_back": loaded,
            **{k: round(v, 3) for k, v in metrics(result).items()
               if k in ("cache_hit_ratio", "avg_latency_s", "p99_latency_s")}}  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--model-path", default="tiny", help="HF model dir, 'tiny', '8b-shape' or a preble model name"
    )
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--prefix-lens", default="1024,4000")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--copy-volume", default="", help="a workload: copies by policy")
    parser.add_argument("--rps", type=float, default=11.0, help="--copy-volume: the trace's rate")
    parser.add_argument("--host-tokens", type=int, default=180_000, help="--copy-volume: the host tier")
    parser.add_argument("--host-copy-ahead", action=argparse.BooleanOptionalAction, default=True,
                        help="--copy-volume: copies ahead of eviction (the engines' default)")  # fmt: skip
    args = parser.parse_args(argv)
    if args.copy_volume:
        volume = copy_volume(args.copy_volume, 3000, args.rps, 60_000, args.host_tokens, args.host_copy_ahead)
        print(json.dumps(volume))
        return
    lens = [int(n) for n in args.prefix_lens.split(",")]
    device_tokens = max(lens) + 4 * args.page_size  # holds one prefix
    if args.model_path == "8b-shape":
        from preble_backend.benchmarks.attention_backends import GPU, write_model

        model = write_model(GPU, tempfile.mkdtemp(prefix="preble-8b-shape-"))
    else:
        model = str(resolve_model(args.model_path))
    engine = Engine(EngineConfig(model, device=args.device, dtype=args.dtype, page_size=args.page_size,
                                 max_num_tokens=device_tokens, host_kv_tokens=4 * device_tokens,
                                 chunk_size=2048))  # fmt: skip
    if engine.runner.device.type == "cuda":
        engine.warm_up()  # Triton compiles at first use: not a recompute's cost
    vocab = engine.model_config.vocab_size
    print(json.dumps({"model": args.model_path, "device": str(engine.runner.device), "host": platform.node(),
                      "date": time.strftime("%Y-%m-%d"), "rounds": args.rounds}))  # fmt: skip
    for n in lens:
        print(json.dumps(measure(engine, n, args.rounds, vocab)))


if __name__ == "__main__":
    main()
