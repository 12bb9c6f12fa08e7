"""The ``preble`` command. ``demo`` runs the engine on the tiny model from the command line."""

from __future__ import annotations

import argparse
import sys
import time

from preble_backend.config import EngineConfig
from preble_backend.engine import Engine
from preble_backend.tiny_model import tiny_model_path


def demo(args: argparse.Namespace) -> int:
    from transformers import AutoTokenizer

    model_path = args.model_path or str(tiny_model_path())
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    engine = Engine(EngineConfig(model_path=model_path, chunk_size=args.chunk_size))
    shared = "You are a tool-using agent. Tools: " + " ".join(f"tool_{i}(query, limit)" for i in range(120))
    questions = [
        "Find the weather in Paris.",
        "Summarize the video scene.",
        "List open issues.",
        "Translate the document.",
        "Plan a route by bicycle.",
        "Check the server load.",
    ]
    prompts = [tokenizer.encode(f"{shared}\nUser: {q}\nAssistant:") for q in questions]
    print(f"model {model_path}: {len(prompts)} prompts of ~{len(prompts[0])} tokens sharing a prefix")
    params = {"max_tokens": args.max_tokens, "temperature": 0}
    start = time.perf_counter()
    first = engine.generate(prompts[:1], params)  # warms the cache with the shared prefix
    rest = engine.generate(prompts[1:], params)
    elapsed = time.perf_counter() - start
    for q, out in zip(questions, first + rest):
        print(f"  {q!r} -> {tokenizer.decode(out)[:60]!r}")
    stats = engine.stats()
    generated = sum(len(o) for o in first + rest)
    print(
        f"{generated} tokens in {elapsed:.2f}s ({generated / elapsed:.1f} tok/s); prompt tokens "
        f"computed {stats['prompt_tokens_computed']}, served from cache {stats['prompt_tokens_cached']}"
    )
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="preble", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("demo", help="generate for a few prompts sharing a prefix, print tok/s and cache hits")
    p.add_argument("--model-path", default=None, help="local HF model directory (default: tiny model)")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--chunk-size", type=int, default=512)
    p.set_defaults(func=demo)
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
