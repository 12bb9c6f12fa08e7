"""Benchmark: N requests sharing a long prefix, with the engine's prefix cache on and off.

Reports prompt tokens computed vs served from cache, wall time, and mean time to first
token, for both settings in the same run, and their ratio. Usage:

    python -m preble_backend.benchmarks.prefix_cache --num-requests 8 --prefix-len 2048
"""

from __future__ import annotations

import argparse
import platform
import time

import torch

from preble_backend.engine.config import EngineConfig
from preble_backend.engine.engine import Engine
from preble_backend.model.tiny_model import tiny_model_path


def run(engine: Engine, prompts: list[list[int]], max_tokens: int) -> dict[str, float]:
    before = engine.stats()
    start = time.perf_counter()
    first_token: dict[str, float] = {}
    finished = []

    def on_output(out):
        first_token.setdefault(out.request_id, time.perf_counter() - start)
        if out.finished:
            finished.append(out.request_id)

    for i, prompt in enumerate(prompts):
        engine.add_request(
            f"bench-{id(prompts)}-{i}",
            prompt,
            {"max_tokens": max_tokens, "temperature": 0, "ignore_eos": True},
            on_output,
        )
    while engine.has_work():
        engine.step()
    wall = time.perf_counter() - start
    stats = engine.stats()
    assert len(finished) == len(prompts)
    return {
        "wall_s": wall,
        "mean_ttft_s": sum(first_token.values()) / len(first_token),
        "computed": stats["prompt_tokens_computed"] - before["prompt_tokens_computed"],
        "cached": stats["prompt_tokens_cached"] - before["prompt_tokens_cached"],
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-path", default=None, help="local HF model dir (default: tiny model)")
    parser.add_argument("--num-requests", type=int, default=8)
    parser.add_argument("--prefix-len", type=int, default=2048)
    parser.add_argument("--suffix-len", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--chunk-size", type=int, default=512)
    args = parser.parse_args(argv)

    model_path = args.model_path or str(tiny_model_path())
    gen = torch.Generator().manual_seed(0)
    prefix = torch.randint(3, 2000, (args.prefix_len,), generator=gen).tolist()
    prompts = [
        prefix + torch.randint(3, 2000, (args.suffix_len,), generator=gen).tolist()
        for _ in range(args.num_requests)
    ]
    results = {}
    for caching in (False, True):
        engine = Engine(
            EngineConfig(model_path=model_path, chunk_size=args.chunk_size, enable_prefix_caching=caching)
        )
        engine.generate([prefix[:64]], {"max_tokens": 2})  # warm-up, then drop its cache
        engine.flush_cache()
        results[caching] = run(engine, prompts, args.max_tokens)
    off, on = results[False], results[True]
    print(
        f"# {args.num_requests} requests, {args.prefix_len}-token shared prefix + {args.suffix_len}-token "
        f"suffix, {args.max_tokens} output tokens, chunk {args.chunk_size}; "
        f"{platform.processor() or platform.machine()}, torch threads {torch.get_num_threads()}"
    )
    print("| prefix cache | prompt tokens computed | served from cache | wall time (s) | mean TTFT (s) |")
    print("|---|---|---|---|---|")
    for name, r in (("off", off), ("on", on)):
        print(f"| {name} | {r['computed']} | {r['cached']} | {r['wall_s']:.2f} | {r['mean_ttft_s']:.2f} |")
    print(
        f"| off / on | {off['computed'] / on['computed']:.2f}x | | {off['wall_s'] / on['wall_s']:.2f}x "
        f"| {off['mean_ttft_s'] / on['mean_ttft_s']:.2f}x |"
    )


if __name__ == "__main__":
    main()
