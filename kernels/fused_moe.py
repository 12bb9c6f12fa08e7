"""Fused mixture-of-experts: every expert's tokens in one grouped GEMM per projection.

The (token, choice) pairs are sorted by expert and each expert's run padded to a multiple
of ``BLOCK_M`` (``align_block_size``, what vLLM's and SGLang's ``moe_align_block_size``
compute), so one tile of rows never mixes experts: a program reads its block's expert id,
gathers its rows of the input, and multiplies them by that expert's weight tile. Padding
rows carry an out-of-range id and are neither read nor written. Two launches follow the
router: gate and up together (``[E, 2I, H]``), then down (``[E, H, I]``) with each row
weighted by its router weight; each token's ``top_k`` rows are then summed. Experts with
biases (gpt-oss) add their expert's bias row in the kernel, before the router weight; the
gate is applied between the launches (``glu``: ``silu(gate) * up`` by default, gpt-oss's
clamped SwiGLU). The reference
is ``reference.fused_moe_ref``; block sizes are ``tuning.MOE_TABLE``'s. ``grouped_moe_torch``
is the same computation with torch's grouped product (transformers' default experts): the
CPU engine's path, and what ``moe_benchmark`` holds the kernel against on a GPU.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from kernels.reference import silu_and_mul
from kernels.tuning import moe_blocks_for, upcast_loads

# torch's grouped matrix product, with a CPU kernel from torch 2.11 (transformers uses it
# from there); None: the caller loops over experts
GROUPED_MM = None
if tuple(int(v) for v in torch.__version__.split("+")[0].split(".")[:2]) >= (2, 11):
    GROUPED_MM = getattr(F, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)


def align_block_size(topk_ids: torch.Tensor, num_experts: int, block_m: int):
    """``topk_ids`` [T, k] -> (``sorted_ids`` [P]: indices into the flattened pairs, grouped
    by expert, each group padded with ``T * k`` to a multiple of ``block_m``;
    ``expert_of_block`` [P / block_m]; P). Stable: an expert's pairs keep token order."""
    flat = topk_ids.flatten()
    counts = torch.bincount(flat, minlength=num_experts)
    padded = (counts + block_m - 1) // block_m * block_m
    starts = torch.cumsum(padded, 0) - padded
    order = torch.argsort(flat, stable=True)
    first = torch.cumsum(counts, 0) - counts  # each expert's first position in ``order``
    rank_in_expert = torch.arange(flat.numel(), device=flat.device) - first[flat[order]]
    total = int(padded.sum())
    sorted_ids = torch.full((total,), flat.numel(), dtype=torch.int32, device=flat.device)
    sorted_ids[starts[flat[order]] + rank_in_expert] = order.to(torch.int32)
    experts = torch.arange(num_experts, device=flat.device, dtype=torch.int32)
    return sorted_ids, torch.repeat_interleave(experts, padded // block_m), total


@triton.jit
def _grouped_gemm_kernel(
    A, W, C, SortedIds, ExpertOfBlock, RouterWeights, Bias,
    num_pairs, N, K, top_k_of_a,
    stride_am, stride_we, stride_wn, stride_wk, stride_cm,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    WEIGHTED: tl.constexpr, HAS_BIAS: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    """C[pair, n] = (A[pair // top_k_of_a] . W[expert, n] + Bias[expert, n]) (x the pair's
    router weight)."""
    block = tl.program_id(0)
    pid_n = tl.program_id(1)
    expert = tl.load(ExpertOfBlock + block).to(tl.int64)
    rows = block * BLOCK_M + tl.arange(0, BLOCK_M)
    pair = tl.load(SortedIds + rows)
    real = pair < num_pairs
    a_row = (pair // top_k_of_a).to(tl.int64)
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < N
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        k_ok = k < K
        a_mask = real[:, None] & k_ok[None, :]
        a = tl.load(A + a_row[:, None] * stride_am + k[None, :], mask=a_mask, other=0.0)
        w = tl.load(W + expert * stride_we + n[None, :] * stride_wn + k[:, None] * stride_wk,
                    mask=n_ok[None, :] & k_ok[:, None], other=0.0)  # fmt: skip
        if UPCAST:
            a = a.to(tl.float32)
            w = w.to(tl.float32)
        acc += tl.dot(a, w, input_precision=PRECISION)
    if HAS_BIAS:
        acc += tl.load(Bias + expert * N + n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    if WEIGHTED:
        acc = acc * tl.load(RouterWeights + pair, mask=real, other=0.0).to(tl.float32)[:, None]
    c = C + pair.to(tl.int64)[:, None] * stride_cm + n[None, :]
    tl.store(c, acc.to(C.dtype.element_ty), mask=real[:, None] & n_ok[None, :])


def _grouped_gemm(
    a, w, out, sorted_ids, expert_of_block, router_weights, top_k_of_a, blocks, bias=None
) -> None:
    num_blocks, n, k = expert_of_block.numel(), w.shape[1], w.shape[2]
    upcast = upcast_loads(a.dtype)
    grid = (num_blocks, triton.cdiv(n, blocks.n))
    _grouped_gemm_kernel[grid](
        a, w, out, sorted_ids, expert_of_block, router_weights if router_weights is not None else a,
        bias.contiguous() if bias is not None else a,
        out.shape[0], n, k, top_k_of_a,
        a.stride(0), w.stride(0), w.stride(1), w.stride(2), out.stride(0),
        BLOCK_M=blocks.m, BLOCK_N=blocks.n, BLOCK_K=blocks.k, WEIGHTED=router_weights is not None,
        HAS_BIAS=bias is not None, UPCAST=upcast, PRECISION="ieee" if upcast else "tf32",
        num_warps=blocks.warps, num_stages=blocks.stages,
    )  # fmt: skip


def fused_moe(x, gate_up, down, topk_weights, topk_ids, glu=silu_and_mul, gate_up_bias=None,
              down_bias=None) -> torch.Tensor:  # fmt: skip
    """``x`` [T, H]; ``gate_up`` [E, 2I, H] (gate rows, then up); ``down`` [E, H, I];
    ``topk_weights``/``topk_ids`` [T, k] from the router; the biases [E, 2I], [E, H] where
    the experts have them. Returns [T, H] in ``x``'s dtype: the sum over each token's
    experts of ``weight * down(glu(gate, up))``."""
    tokens, top_k = topk_ids.shape
    if tokens == 0:
        return torch.zeros_like(x)
    x = x.contiguous()  # the weights may be views of either orientation: the kernel takes strides
    blocks = moe_blocks_for(x.device)
    sorted_ids, expert_of_block, _ = align_block_size(topk_ids, gate_up.shape[0], blocks.m)
    pairs, inter = tokens * top_k, down.shape[2]
    hidden = torch.empty((pairs, 2 * inter), dtype=x.dtype, device=x.device)
    _grouped_gemm(x, gate_up, hidden, sorted_ids, expert_of_block, None, top_k, blocks, gate_up_bias)
    act = glu(hidden[:, :inter], hidden[:, inter:]).contiguous()
    out = torch.empty((pairs, down.shape[1]), dtype=x.dtype, device=x.device)
    weights = topk_weights.flatten().contiguous()
    _grouped_gemm(act, down, out, sorted_ids, expert_of_block, weights, 1, blocks, down_bias)
    return out.view(tokens, top_k, -1).sum(dim=1)


def grouped_moe_torch(x, gate_up, down, topk_weights, topk_ids, glu=silu_and_mul, gate_up_bias=None,
                      down_bias=None) -> torch.Tensor:  # fmt: skip
    """``fused_moe``'s result by torch's grouped product, as transformers' ``grouped_mm``
    experts compute it: the pairs sorted by expert, one grouped product per projection
    (its expert's bias added), the router weight applied, then each token's choices summed
    in choice order."""
    top_k, num_experts = topk_ids.shape[1], gate_up.shape[0]
    by_expert, perm = torch.sort(topk_ids.reshape(-1))
    offsets = torch.cumsum(torch.bincount(by_expert, minlength=num_experts), dim=0, dtype=torch.int32)
    h = GROUPED_MM(x[perm // top_k], gate_up.transpose(-2, -1), offs=offsets)
    if gate_up_bias is not None:
        h.add_(gate_up_bias[by_expert])
    gate, up = h.chunk(2, dim=-1)
    y = GROUPED_MM(glu(gate, up), down.transpose(-2, -1), offs=offsets)
    if down_bias is not None:
        y.add_(down_bias[by_expert])
    y = y * topk_weights.reshape(-1)[perm].unsqueeze(-1)
    return y[torch.argsort(perm)].view(x.shape[0], top_k, -1).sum(dim=1).to(x.dtype)
