"""What a long context costs a model with sliding-window layers: the KV each pool holds.

    python -m preble_backend.benchmarks.sliding_memory --context 32768 --window 4096

A random Gemma-3-shaped checkpoint (five sliding layers to one full, the given window;
small widths, so the CPU runs a 32k-token prefill) serves one prompt of ``--context``
tokens under chunked prefill, twice: with a window pool of the least the engine accepts
(one window and one chunk, ``window_kv_tokens``) and with the default one (half the KV
capacity). After each iteration it reads the pools: the full layers' pages in use, the
window pages some running request needs, and the window pages in use (needed, or idle:
kept for later hits). Prints the peaks, in tokens, against ``window + chunk``, and the KV
bytes each engine holds against an engine that keeps every layer's KV of every token.
Both runs must produce the same tokens.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import torch


def write_checkpoint(path: Path, window: int, context: int) -> None:
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    cfg = Gemma3TextConfig(vocab_size=384, hidden_size=64, intermediate_size=96, num_hidden_layers=6,
                           num_attention_heads=4, num_key_value_heads=2, head_dim=32, sliding_window=window,
                           sliding_window_pattern=6, query_pre_attn_scalar=32,
                           max_position_embeddings=context + 1024, eos_token_id=1,
                           bos_token_id=0)  # fmt: skip
    cfg.architectures = ["Gemma3ForCausalLM"]
    torch.manual_seed(0)
    Gemma3ForCausalLM(cfg).save_pretrained(path)


def serve(model: Path, prompt: list[int], window_tokens: int, args) -> dict:
    from preble_backend.engine.config import EngineConfig
    from preble_backend.engine.engine import Engine

    engine = Engine(EngineConfig(model_path=str(model), dtype="float32", page_size=args.page_size,
                                 chunk_size=args.chunk, max_num_tokens=args.context + 1024,
                                 window_kv_tokens=window_tokens))  # fmt: skip
    pool, windows = engine.pool, engine.scheduler.blocks.windows
    out: list[int] = []
    engine.add_request("long", prompt, {"temperature": 0, "max_tokens": 8}, lambda o: out.extend(o.token_ids))
    peak = {"full": 0, "needed": 0, "window": 0}
    engine.step()  # takes the request in
    while engine.scheduler.has_work():
        engine.step()
        peak["full"] = max(peak["full"], pool.num_used)
        peak["needed"] = max(peak["needed"], sum(1 for n in windows.need if n))
        peak["window"] = max(peak["window"], pool.window.num_used)
    kv_bytes = sum(t.numel() * t.element_size() for t in (pool.k_cache, pool.v_cache))
    window_bytes = sum(t.numel() * t.element_size() for t in (pool.window.k_cache, pool.window.v_cache))
    per_page_all = (kv_bytes // pool.num_pages) + (window_bytes // pool.window.num_pages)
    engine.shutdown()
    ps = args.page_size
    return {"tokens": out, "window_pages": pool.window.num_pages, **{k: v * ps for k, v in peak.items()},
            "held_bytes": peak["full"] * (kv_bytes // pool.num_pages)
            + peak["window"] * (window_bytes // pool.window.num_pages),
            "all_layers_bytes": peak["full"] * per_page_all}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--context", type=int, default=32768)
    ap.add_argument("--window", type=int, default=4096)
    ap.add_argument("--chunk", type=int, default=512)
    ap.add_argument("--page-size", type=int, default=16)
    args = ap.parse_args(argv)
    torch.set_num_threads(max(1, torch.get_num_threads()))
    ps = args.page_size
    least = (-(-(args.window + args.chunk) // ps) + 1) * ps
    prompt = torch.randint(3, 384, (args.context,), generator=torch.Generator().manual_seed(1)).tolist()
    with tempfile.TemporaryDirectory() as tmp:
        write_checkpoint(Path(tmp), args.window, args.context)
        runs = {"least": serve(Path(tmp), prompt, least, args), "default": serve(Path(tmp), prompt, 0, args)}
    bound = args.window + args.chunk
    print(f"context {args.context} tokens, window {args.window}, chunk {args.chunk}, page {ps}: "
          f"window + chunk = {bound} tokens ({bound + ps} page-rounded)")  # fmt: skip
    for name, r in runs.items():
        print(f"{name:>8} window pool {r['window_pages'] * ps:6d} tokens | "
              f"peak full-layer KV {r['full']:6d} | "
              f"peak sliding KV needed {r['needed']:5d} | peak sliding KV held {r['window']:6d} | "
              f"KV bytes held {r['held_bytes'] / 2**20:6.1f} MiB vs {r['all_layers_bytes'] / 2**20:6.1f} MiB "
              f"keeping every layer")  # fmt: skip
    same = runs["least"]["tokens"] == runs["default"]["tokens"] and len(runs["least"]["tokens"]) == 8
    print(f"same tokens in both runs: {same}")
    ok = (
        same
        and all(r["needed"] <= bound + ps for r in runs.values())
        and runs["least"]["window"] <= bound + ps
    )
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
