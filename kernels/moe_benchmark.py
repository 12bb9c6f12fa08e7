"""The fused MoE kernel against torch's grouped product on this GPU, batch 1 to 256:

    python -m kernels.moe_benchmark          # on the GPU machine (kernels/gpu_check.sh moe)

One layer of Qwen3-30B-A3B's shape in bf16 (hidden 2048, 128 experts of 768, top 8) and of
Mixtral-8x7B's (hidden 4096, 8 experts of 14336, top 2), a router's choice drawn at random
per token. Each batch checks the kernel's output against ``grouped_moe_torch`` (the same
sum by torch's grouped product, transformers' default experts), then times both with
``triton.testing.do_bench``; the ratio is the kernel's time over torch's (issue 62's
target: at most 1.3). Not yet run on any GPU.
"""

from __future__ import annotations

import argparse

import torch

from kernels.fused_moe import GROUPED_MM, fused_moe, grouped_moe_torch

SHAPES = {  # hidden, experts, intermediate, top_k
    "qwen3_30b_a3b": (2048, 128, 768, 8),
    "mixtral_8x7b": (4096, 8, 14336, 2),
}


def case(hidden: int, experts: int, inter: int, top_k: int, batch: int, device, dtype):
    gen = torch.Generator(device=device).manual_seed(batch)
    x = torch.randn(batch, hidden, device=device, dtype=dtype, generator=gen)
    gate_up = (
        torch.randn(experts, 2 * inter, hidden, device=device, dtype=dtype, generator=gen) * hidden**-0.5
    )
    down = torch.randn(experts, hidden, inter, device=device, dtype=dtype, generator=gen) * inter**-0.5
    logits = torch.randn(batch, experts, device=device, generator=gen)
    weights, ids = torch.topk(torch.softmax(logits, -1), top_k, dim=-1)
    return x, gate_up, down, weights / weights.sum(-1, keepdim=True), ids


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--batches", default="1,4,16,64,256")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available() or GROUPED_MM is None:
        print("kernels.moe_benchmark needs a CUDA GPU and torch 2.11 or later (its grouped product)")
        return 2
    import triton

    device, dtype = torch.device("cuda"), torch.bfloat16
    print(
        f"{torch.cuda.get_device_name(device)}, torch {torch.__version__}, triton {triton.__version__}, bf16"
    )
    print("| shape | batch | fused ms | grouped torch ms | ratio | rel. diff |\n|---|---|---|---|---|---|")
    for name in args.shapes.split(","):
        for batch in (int(b) for b in args.batches.split(",")):
            inputs = case(*SHAPES[name], batch, device, dtype)
            ours, theirs = fused_moe(*inputs), grouped_moe_torch(*inputs)
            diff = ((ours.float() - theirs.float()).norm() / theirs.float().norm()).item()
            fused_ms = triton.testing.do_bench(lambda i=inputs: fused_moe(*i))
            torch_ms = triton.testing.do_bench(lambda i=inputs: grouped_moe_torch(*i))
            ratio = fused_ms / torch_ms
            print(f"| {name} | {batch} | {fused_ms:.3f} | {torch_ms:.3f} | {ratio:.2f} | {diff:.1e} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
