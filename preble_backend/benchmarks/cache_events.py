"""What the radix cache's bookkeeping costs a long prompt stored chunk by chunk, as a
chunked prefill stores it: each chunk inserted (its pages shared at once), then the events
drained, as an engine does between iterations. No model runs: this is the engine loop's
own time per prompt. Usage:

    python -m preble_backend.benchmarks.cache_events --prompt-len 16384 --chunk 512
"""

from __future__ import annotations

import argparse
import platform
import random
import time

from preble_backend.engine.cache.radix_cache import RadixCache


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompt-len", type=int, default=16384)
    parser.add_argument("--chunk", type=int, default=512)
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--prompts", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    rng = random.Random(0)
    prompts = [[rng.randrange(32000) for _ in range(args.prompt_len)] for _ in range(args.prompts)]
    num_pages = args.prompt_len // args.page_size
    best = float("inf")
    for _ in range(args.repeats):
        cache = RadixCache(args.page_size)
        start = time.perf_counter()
        for p, tokens in enumerate(prompts):
            pages = list(range(p * num_pages, (p + 1) * num_pages))
            for end in range(args.chunk, args.prompt_len + 1, args.chunk):
                cache.insert(tokens[:end], pages[: end // args.page_size])
            cache.drain_events()
        best = min(best, (time.perf_counter() - start) / args.prompts)
    print(
        f"{platform.processor() or platform.machine()}: {best * 1e3:.2f} ms per {args.prompt_len}-token "
        f"prompt stored in {args.chunk}-token chunks, events drained (best of {args.repeats})"
    )


if __name__ == "__main__":
    main()
