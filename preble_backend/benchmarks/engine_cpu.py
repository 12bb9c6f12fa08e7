"""The CPU engine against transformers on the same model, dtype and threads: prefill
throughput, decode at batch 1 and at batch 8, and whether greedy output is identical.

    python -m preble_backend.benchmarks.engine_cpu --model smollm2 --backends torch,sdpa

Each measurement alternates the two sides ``--rounds`` times and keeps each side's best
(the host is shared: the best is the least disturbed). The engine runs with its prefix
cache flushed before every round, so nothing is served from cache; transformers
generates with its own KV cache (``generate``, greedy, EOS banned by ``min_new_tokens``,
as ``min_tokens`` bans it in the engine). Batch 8 is eight
different prompts of the same length, so transformers needs no padding.
"""

from __future__ import annotations

import argparse
import time

import torch

from preble_backend.engine.config import EngineConfig
from preble_backend.engine.engine import Engine


def prompts(n: int, length: int, vocab: int, seed: int = 0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (length,), generator=gen).tolist() for _ in range(n)]


class Transformers:
    def __init__(self, path: str) -> None:
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()

    @torch.inference_mode()
    def prefill(self, prompt: list[int]) -> None:
        self.model(torch.tensor([prompt]))

    @torch.inference_mode()
    def generate(self, batch: list[list[int]], max_tokens: int) -> list[list[int]]:
        ids = torch.tensor(batch)
        out = self.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_tokens,
                                  min_new_tokens=max_tokens, do_sample=False, pad_token_id=0)  # fmt: skip
        return out[:, ids.shape[1] :].tolist()


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def run(path: str, backend: str, args, reference: Transformers) -> dict:
    vocab = reference.model.config.vocab_size
    engine = Engine(EngineConfig(model_path=path, attention_backend=backend, chunk_size=args.chunk_size,
                                 max_num_tokens=16384))  # fmt: skip
    # min_tokens bans EOS as transformers' min_new_tokens does (with ignore_eos it would not)
    n = args.max_tokens
    greedy = {"temperature": 0, "max_tokens": n, "min_tokens": n}

    def engine_generate(batch, params):
        engine.flush_cache()
        return engine.generate(batch, params)

    [long_prompt] = prompts(1, args.prefill_tokens, vocab, seed=1)
    one, eight = prompts(1, 64, vocab, seed=2), prompts(8, 64, vocab, seed=3)
    engine_generate(one, greedy)  # warm both
    reference.generate(one, 4)
    result = {"backend": backend}
    first = {"temperature": 0, "max_tokens": 1, "ignore_eos": True}
    for name, fn_engine, fn_ref, tokens in (
        ("prefill", lambda: engine_generate([long_prompt], first), lambda: reference.prefill(long_prompt),
         args.prefill_tokens),
        ("decode_b1", lambda: engine_generate(one, greedy), lambda: reference.generate(one, n), n),
        ("decode_b8", lambda: engine_generate(eight, greedy), lambda: reference.generate(eight, n), 8 * n),
    ):  # fmt: skip
        t_engine, t_ref = [], []
        for _ in range(args.rounds):  # alternated, so both see the same host
            t_engine.append(timed(fn_engine))
            t_ref.append(timed(fn_ref))
        result[name] = {"engine_tok_s": tokens / min(t_engine), "transformers_tok_s": tokens / min(t_ref),
                        "ratio": min(t_ref) / min(t_engine)}  # fmt: skip
    ours, theirs = engine_generate(eight, greedy), reference.generate(eight, args.max_tokens)
    result["greedy_identical"] = sum(a == b for a, b in zip(ours, theirs))
    result["first_difference"] = min((next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), len(a))
                                      for a, b in zip(ours, theirs)), default=0)  # fmt: skip
    return result


def main(argv: list[str] | None = None) -> None:
    from preble_backend.model.pypi_models import resolve

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2", help="model name or directory")
    parser.add_argument("--backends", default="torch,sdpa", help="comma-separated attention backends")
    parser.add_argument("--prefill-tokens", type=int, default=1024)
    parser.add_argument("--max-tokens", type=int, default=128, help="decode tokens per request")
    parser.add_argument("--chunk-size", type=int, default=1024, help="the engine's prefill chunk")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args(argv)
    path = resolve(args.model)
    reference = Transformers(path)
    print(f"{path}: fp32, {torch.get_num_threads()} threads, {args.rounds} rounds (best of each)")
    for backend in args.backends.split(","):
        r = run(path, backend, args, reference)
        cells = "  ".join(
            f"{k} {r[k]['engine_tok_s']:.0f} vs {r[k]['transformers_tok_s']:.0f} tok/s ({r[k]['ratio']:.2f}x)"
            for k in ("prefill", "decode_b1", "decode_b8")
        )
        print(
            f"  {backend:6s} {cells}  greedy: {r['greedy_identical']} of 8 identical to transformers' "
            f"(earliest difference at token {r['first_difference']})"
        )


if __name__ == "__main__":
    main()
