"""The engine per attention backend: its logits and greedy tokens against transformers on the
same device and dtype, and its speed on a batch that shares a long prefix.

    python -m preble_backend.benchmarks.attention_backends                # CUDA, bf16, every backend
    python -m preble_backend.benchmarks.attention_backends --smoke        # tiny shapes, fp32 (CI)

The model is written by the script (no hub): random weights with Llama-3-8B's layer shape
(hidden 4096, 32 query heads, 8 KV heads, head_dim 128, MLP 14336) and fewer layers. Logits
are taken at each request's last prompt position, its shared prefix served from the radix
cache, and compared with transformers in fp32: the engine's error should be of the size of
transformers' own in the same dtype. Greedy tokens are compared with transformers' in the
same dtype, where rounding alone may fork a sequence late.
"""

from __future__ import annotations

import argparse
import gc
import platform
import tempfile
from dataclasses import dataclass, replace

import torch

from preble_backend.benchmarks.prefix_cache import run as run_batch
from preble_backend.engine.config import EngineConfig
from preble_backend.engine.engine import Engine


@dataclass
class Shape:
    hidden: int
    heads: tuple[int, int]  # query heads, KV heads
    mlp: int
    layers: int
    vocab: int
    prefix: int  # shared prefix tokens
    suffixes: tuple[int, int]  # own suffix length range
    batch: int
    max_tokens: int
    parity_requests: int


GPU = Shape(4096, (32, 8), 14336, 4, 32000, 4096, (32, 256), 64, 64, 8)
SMOKE = Shape(128, (4, 2), 256, 2, 512, 96, (4, 24), 4, 4, 2)


def write_model(shape: Shape, path: str) -> str:
    """A Llama checkpoint with N(0, 0.02) weights, norms at 1 (bf16 on disk)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=shape.vocab, hidden_size=shape.hidden, intermediate_size=shape.mlp,
        num_hidden_layers=shape.layers, num_attention_heads=shape.heads[0],
        num_key_value_heads=shape.heads[1], max_position_embeddings=16384, rope_theta=500000.0,
        eos_token_id=1, bos_token_id=0,
    )  # fmt: skip
    cfg.architectures = ["LlamaForCausalLM"]
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).to(torch.bfloat16)
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.fill_(1.0) if "norm" in name else param.normal_(0.0, 0.02)
    model.save_pretrained(path, safe_serialization=True)
    return path


def prompts_for(shape: Shape) -> list[list[int]]:
    gen = torch.Generator().manual_seed(1)
    prefix = torch.randint(3, shape.vocab, (shape.prefix,), generator=gen).tolist()
    low, high = shape.suffixes
    lengths = torch.randint(low, high + 1, (shape.batch,), generator=gen).tolist()
    return [prefix + torch.randint(3, shape.vocab, (n,), generator=gen).tolist() for n in lengths]


class Transformers:
    """transformers' own forward and greedy generate, as the yardstick."""

    def __init__(self, path: str, dtype: torch.dtype, device: str) -> None:
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device).eval()
        self.device = device

    @torch.inference_mode()
    def last_logits(self, prompt: list[int]) -> torch.Tensor:
        ids = torch.tensor([prompt], device=self.device)
        return self.model(ids).logits[0, -1].float().cpu()

    @torch.inference_mode()
    def greedy(self, prompt: list[int], max_tokens: int) -> list[int]:
        ids = torch.tensor([prompt], device=self.device)
        out = self.model.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_tokens, min_new_tokens=max_tokens,
            do_sample=False, pad_token_id=0,
        )  # fmt: skip
        return out[0, len(prompt) :].tolist()


def engine_last_logits(engine: Engine, prompt: list[int]) -> torch.Tensor:
    """The logits the engine samples the first token from (one request alone)."""
    seen, forward = [], engine.runner.forward

    def recording(batch, pool):
        logits, rows = forward(batch, pool)
        if logits.numel():
            seen.append(logits[0].float().cpu())
        return logits, rows

    engine.runner.forward = recording
    try:
        engine.generate([prompt], {"max_tokens": 1, "temperature": 0.0, "ignore_eos": True})
    finally:
        engine.runner.forward = forward
    return seen[-1]


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def measure(backend: str, path: str, shape: Shape, args, refs: dict, prompts: list[list[int]]) -> list[str]:
    engine = Engine(
        EngineConfig(
            model_path=path, device=args.device, dtype=args.dtype, attention_backend=backend,
            max_num_tokens=args.max_num_tokens, chunk_size=args.chunk_size, page_size=16,
        )
    )  # fmt: skip
    try:
        params = {"max_tokens": shape.max_tokens, "temperature": 0.0, "ignore_eos": True}
        engine.generate([prompts[0][:64]], params)  # compiles the kernels
        parity = prompts[: shape.parity_requests]
        errors = [rel(engine_last_logits(engine, p), refs["fp32_logits"][i]) for i, p in enumerate(parity)]
        tokens = engine.generate(parity, params)
        same = [common_prefix(t, r) for t, r in zip(tokens, refs["greedy"])]
        engine.flush_cache()
        cold = run_batch(engine, prompts, shape.max_tokens)
        warm = run_batch(engine, prompts, shape.max_tokens)  # the prefix and suffixes now cached
        cascades = getattr(engine.runner.backend, "cascade_forwards", None)
        out_tokens = len(prompts) * shape.max_tokens
        return [
            backend,
            f"{max(errors):.1e}",
            f"{sum(s == shape.max_tokens for s in same)}/{len(same)} (mean {sum(same) / len(same):.1f})",
            f"{cold['wall_s']:.2f}",
            f"{out_tokens / cold['wall_s']:,.0f}",
            f"{cold['mean_ttft_s'] * 1e3:.0f}",
            f"{warm['wall_s']:.2f}",
            f"{warm['mean_ttft_s'] * 1e3:.0f}",
            "" if cascades is None else str(cascades),
        ]
    finally:
        engine.shutdown()
        del engine
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--smoke", action="store_true", help="tiny shapes, fp32; timings meaningless")
    ap.add_argument("--backends", default="torch,triton,flashinfer", help="comma-separated")
    ap.add_argument("--layers", type=int, default=None, help="decoder layers (default 4; smoke 2)")
    ap.add_argument("--max-num-tokens", type=int, default=262144, help="KV capacity per engine")
    ap.add_argument("--chunk-size", type=int, default=2048, help="prefill tokens per iteration")
    args = ap.parse_args(argv)
    shape = SMOKE if args.smoke else GPU
    if args.layers:
        shape = replace(shape, layers=args.layers)
    # --smoke: fp32 on the CPU, or on the GPU where there is one (its Triton kernels need it)
    smoke_device = "cuda" if torch.cuda.is_available() else "cpu"
    args.device, args.dtype = (smoke_device, "float32") if args.smoke else ("cuda", "bfloat16")
    if args.device == "cuda" and not torch.cuda.is_available():
        print("benchmarks.attention_backends needs a CUDA GPU (or --smoke)")
        return 2
    dtype = getattr(torch, args.dtype)
    prompts = prompts_for(shape)
    with tempfile.TemporaryDirectory() as path:
        write_model(shape, path)
        refs = {}
        parity = prompts[: shape.parity_requests]
        ref = Transformers(path, torch.float32, args.device)
        refs["fp32_logits"] = [ref.last_logits(p) for p in parity]
        del ref
        ref = Transformers(path, dtype, args.device)
        hf_err = max(rel(ref.last_logits(p), refs["fp32_logits"][i]) for i, p in enumerate(parity))
        refs["greedy"] = [ref.greedy(p, shape.max_tokens) for p in parity]
        del ref
        gc.collect()
        rows = []
        for backend in args.backends.split(","):
            try:
                rows.append(measure(backend, path, shape, args, refs, prompts))
            except Exception as err:  # noqa: BLE001 - one backend's failure is a row, not the end
                rows.append([backend, f"failed: {type(err).__name__}: {str(err)[:160]}"] + [""] * 7)
            print("| " + " | ".join(rows[-1]) + " |", flush=True)
    machine = torch.cuda.get_device_name() if args.device == "cuda" else platform.processor() or "CPU"
    print(
        f"\n{machine}, torch {torch.__version__}, {args.dtype}; {shape.layers} layers of hidden "
        f"{shape.hidden}, {shape.heads[0]}/{shape.heads[1]} heads; {shape.batch} requests = "
        f"{shape.prefix}-token shared prefix "
        f"+ {shape.suffixes[0]}-{shape.suffixes[1]} own, {shape.max_tokens} output tokens; chunk "
        f"{args.chunk_size}.\ntransformers {args.dtype} vs fp32, last-position logits: max rel. error "
        f"{hf_err:.1e}\n"
    )
    head = ["backend", "logits rel. err vs fp32 (max)", "greedy = transformers", "cold s", "cold tok/s",
            "cold TTFT ms", "warm s", "warm TTFT ms", "cascade forwards"]  # fmt: skip
    print("| " + " | ".join(head) + " |\n|" + "---|" * len(head))
    for row in rows:
        print("| " + " | ".join(row) + " |")
    return 0 if all(not r[1].startswith("failed") for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
