"""Decode with CUDA graphs against eager decode: time per decode step and tokens/s at small
batches on the Llama-3-8B-shaped model, and whether both give the same tokens.

    python -m preble_backend.benchmarks.decode_graphs            # CUDA, bf16 (and an fp32 token check)
    python -m preble_backend.benchmarks.decode_graphs --smoke    # tiny shapes, CPU (interpreter)

A decode step's time is taken as (wall of N output tokens - wall of 1) / (N - 1) for the
same unshared prompts, the cache flushed before each run, so the prefill cancels out. On
the CPU there are no graphs: ``--smoke`` runs the graphs' padded buffer path eagerly, to
check the script and its tokens, and its times mean nothing.
"""

from __future__ import annotations

import argparse
import gc
import json
import tempfile
import time
from dataclasses import replace

import torch

from preble_backend.benchmarks.attention_backends import GPU, SMOKE, Shape, write_model
from preble_backend.engine.config import EngineConfig
from preble_backend.engine.engine import Engine


def engine_for(path: str, device: str, dtype: str, graphs: bool, max_batch: int) -> Engine:
    engine = Engine(EngineConfig(
        model_path=path, device=device, dtype=dtype, attention_backend="triton", max_num_tokens=65536,
        page_size=16, cuda_graph_max_batch=max_batch if graphs and device == "cuda" else 0,
    ))  # fmt: skip
    if graphs and device != "cuda":  # nothing to capture: the same buffers, run eagerly
        engine.runner.use_decode_graphs(engine.pool, max_batch, capture=False)
    return engine


def timed(engine: Engine, prompts: list[list[int]], max_tokens: int) -> tuple[float, list[list[int]]]:
    engine.flush_cache()
    if engine.runner.device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    out = engine.generate(prompts, {"max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True})
    return time.perf_counter() - start, out


def measure(path: str, shape: Shape, args, batches: list[int], dtype: str) -> dict:
    """Per batch size and mode: the decode step's time and the tokens."""
    gen = torch.Generator().manual_seed(3)
    prompts = [
        torch.randint(3, shape.vocab, (args.prompt,), generator=gen).tolist() for _ in range(max(batches))
    ]
    results: dict = {}
    for graphs in (False, True):
        engine = engine_for(path, args.device, dtype, graphs, max(batches))
        try:
            timed(engine, prompts[:2], 4)  # compiles the kernels outside the timings
            for b in batches:
                first, _ = min(timed(engine, prompts[:b], 1) for _ in range(args.repeats))
                wall, tokens = min(timed(engine, prompts[:b], args.tokens) for _ in range(args.repeats))
                step = (wall - first) / (args.tokens - 1)
                results[(b, graphs)] = {"step_ms": step * 1e3, "tokens_per_s": b / step, "tokens": tokens}
            replays = engine.runner.graphs.replays if engine.runner.graphs else 0
            results[("replays", graphs)] = replays
        finally:
            engine.shutdown()
            del engine
            gc.collect()
    return results


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU; timings meaningless")
    ap.add_argument("--layers", type=int, default=None, help="decoder layers (default 4; smoke 2)")
    ap.add_argument("--batches", default="1,2,4,8,16,32", help="decode batch sizes")
    ap.add_argument("--prompt", type=int, default=128, help="tokens per (unshared) prompt")
    ap.add_argument("--tokens", type=int, default=64, help="output tokens per request")
    ap.add_argument("--repeats", type=int, default=3, help="best of this many runs")
    ap.add_argument("--json", default=None, help="also write the results here")
    args = ap.parse_args(argv)
    shape = SMOKE if args.smoke else GPU
    if args.layers:
        shape = replace(shape, layers=args.layers)
    if args.smoke:
        args.device, dtypes, args.tokens, args.repeats = "cpu", ["float32"], min(args.tokens, 4), 1
        args.batches, args.prompt = "1,3", min(args.prompt, 16)
    elif not torch.cuda.is_available():
        print("benchmarks.decode_graphs needs a CUDA GPU (or --smoke)")
        return 2
    else:
        args.device, dtypes = "cuda", ["bfloat16", "float32"]
    batches = [int(b) for b in args.batches.split(",")]
    rows, record = [], {}
    with tempfile.TemporaryDirectory() as path:
        write_model(shape, path)
        for dtype in dtypes:
            res = measure(path, shape, args, batches, dtype)
            for b in batches:
                eager, graphed = res[(b, False)], res[(b, True)]
                same = sum(e == g for e, g in zip(eager["tokens"], graphed["tokens"]))
                speed = graphed["tokens_per_s"] / eager["tokens_per_s"]
                rows.append([dtype, str(b), f"{eager['step_ms']:.2f}", f"{graphed['step_ms']:.2f}",
                             f"{eager['tokens_per_s']:,.0f}", f"{graphed['tokens_per_s']:,.0f}",
                             f"{speed:.2f}", f"{same}/{b}"])  # fmt: skip
                record[f"{dtype}/{b}"] = {"eager_ms": eager["step_ms"], "graph_ms": graphed["step_ms"],
                                          "same_tokens": same}  # fmt: skip
            record[f"{dtype}/replays"] = res[("replays", True)]
    machine = torch.cuda.get_device_name() if args.device == "cuda" else "CPU (interpreter: no graphs)"
    print(f"{machine}, torch {torch.__version__}; {shape.layers} layers of hidden {shape.hidden}, "
          f"{shape.heads[0]}/{shape.heads[1]} heads, vocab {shape.vocab}; {args.prompt}-token prompts, "
          f"{args.tokens} output tokens, best of {args.repeats}\n")  # fmt: skip
    head = ["dtype", "batch", "eager step ms", "graph step ms", "eager tok/s", "graph tok/s", "graph ÷ eager",
            "same tokens"]  # fmt: skip
    print("| " + " | ".join(head) + " |\n|" + "---|" * len(head))
    for row in rows:
        print("| " + " | ".join(row) + " |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"machine": machine, **record}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
