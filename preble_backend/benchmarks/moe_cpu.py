"""The CPU engine's mixture-of-experts layer against transformers' own, on the same weights.

    python -m preble_backend.benchmarks.moe_cpu --batches 1,16 --rounds 7
    python -m preble_backend.benchmarks.moe_cpu --family gpt_oss --impls grouped_mm

One Qwen3-MoE block (by default Qwen3-30B-A3B's: hidden 2048, 128 experts of 768, top 8)
in fp32: ``model/moe.py``'s ``SparseMoE`` beside transformers' ``Qwen3MoeSparseMoeBlock``
holding the same tensors, with each of its expert implementations (``grouped_mm``, what
``from_pretrained`` picks, and ``eager``, its loop over experts). ``--family gpt_oss``:
gpt-oss-20b's MLP instead (hidden 2880, 32 experts of 2880, top 4, biases, the clamped
SwiGLU) beside transformers' ``GptOssMLP``, its experts interleaved as its checkpoints
hold them. Each round times both,
alternating which goes first, over ``--repeats`` forwards of a batch of tokens (a decode
step's batch); the outputs must agree.
Prints, per batch, each side's median milliseconds and the ratio of medians, with the
range of the per-round ratios (the host is shared: report the spread).
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import time

import torch


def build(family: str, hidden: int, experts: int, inter: int, top_k: int, impls: list[str]):
    from transformers import GptOssConfig, Qwen3MoeConfig
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssMLP
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    from preble_backend.model.model_config import ModelConfig
    from preble_backend.model.moe import SparseMoE

    raw = dict(architectures=["Qwen3MoeForCausalLM"], vocab_size=256, hidden_size=hidden, num_hidden_layers=1,
               intermediate_size=inter, num_attention_heads=16, num_key_value_heads=4, num_experts=experts,
               num_experts_per_tok=top_k, moe_intermediate_size=inter, norm_topk_prob=True)  # fmt: skip
    if family == "gpt_oss":
        raw = {**raw, "architectures": ["GptOssForCausalLM"], "num_local_experts": raw.pop("num_experts")}
        del raw["moe_intermediate_size"], raw["norm_topk_prob"]
    ours = SparseMoE(ModelConfig.from_dict(raw)).eval()
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in ours.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.02)
    theirs = {}
    for impl in impls:
        cfg = (GptOssConfig if family == "gpt_oss" else Qwen3MoeConfig)(**raw)
        cfg._experts_implementation = impl
        block = (GptOssMLP if family == "gpt_oss" else Qwen3MoeSparseMoeBlock)(cfg).eval()
        block.load_state_dict(ours.state_dict() if family != "gpt_oss" else _interleaved(ours.state_dict()))
        theirs[impl] = block
    return ours, theirs


def _interleaved(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``SparseMoE``'s tensors as gpt-oss's checkpoints hold them (``model/moe.py`` undoes it)."""

    def weave(t: torch.Tensor) -> torch.Tensor:  # [..., 2I] gate then up -> gate and up alternating
        gate, up = t.chunk(2, dim=-1)
        return torch.stack([gate, up], dim=-1).flatten(-2)

    return {
        "router.weight": state["gate.weight"], "router.bias": state["gate.bias"],
        "experts.gate_up_proj": weave(state["experts.gate_up_proj"]),  # both held input-major
        "experts.gate_up_proj_bias": weave(state["experts.gate_up_proj_bias"]),
        "experts.down_proj": state["experts.down_proj"],
        "experts.down_proj_bias": state["experts.down_proj_bias"],
    }  # fmt: skip


@torch.inference_mode()
def timed(layer, x: torch.Tensor, repeats: int, wrap: bool) -> float:
    start = time.perf_counter()
    for _ in range(repeats):
        layer(x[None] if wrap else x)
    return (time.perf_counter() - start) * 1000 / repeats


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--family", choices=("qwen3_moe", "gpt_oss"), default="qwen3_moe")
    ap.add_argument("--hidden", type=int, help="default: Qwen3-30B-A3B's 2048, gpt-oss-20b's 2880")
    ap.add_argument("--experts", type=int, help="default: 128, 32")
    ap.add_argument("--inter", type=int, help="default: 768, 2880")
    ap.add_argument("--top-k", type=int, help="default: 8, 4")
    ap.add_argument("--batches", default="1,16")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--impls", default="grouped_mm,eager", help="transformers' expert implementations")
    args = ap.parse_args(argv)
    shape = {"qwen3_moe": (2048, 128, 768, 8), "gpt_oss": (2880, 32, 2880, 4)}[args.family]
    for key, default in zip(("hidden", "experts", "inter", "top_k"), shape):
        setattr(args, key, getattr(args, key) or default)
    ours, blocks = build(
        args.family, args.hidden, args.experts, args.inter, args.top_k, args.impls.split(",")
    )
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; hidden {args.hidden}, "
          f"{args.experts} experts of {args.inter}, top {args.top_k}, fp32")  # fmt: skip
    for (impl, theirs), batch in itertools.product(blocks.items(), (int(b) for b in args.batches.split(","))):
        x = torch.randn(batch, args.hidden, generator=torch.Generator().manual_seed(batch))
        with torch.inference_mode():
            out = theirs(x[None])
            out = out[0] if isinstance(out, tuple) else out  # GptOssMLP: (hidden, router scores)
            mine = ours(x)  # the same to fp32 rounding (gpt-oss: its layout sums in another order)
            assert (mine - out[0]).abs().max() <= 1e-5 * out[0].abs().max(), "outputs differ"
        mine, hf = [], []
        for r in range(args.rounds):
            order = [(ours, False, mine), (theirs, True, hf)]
            for layer, wrap, times in order[:: 1 if r % 2 == 0 else -1]:  # alternate which runs first
                times.append(timed(layer, x, args.repeats, wrap))
        ratios = [a / b for a, b in zip(mine, hf)]
        ours_ms, their_ms = statistics.median(mine), statistics.median(hf)
        print(f"{impl:10s} batch {batch:3d}: ours {ours_ms:7.2f} ms, transformers {their_ms:7.2f} ms, "
              f"ratio of medians {ours_ms / their_ms:.3f} (per round {min(ratios):.3f}-{max(ratios):.3f}, "
              f"{args.rounds} rounds)")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
