"""Merge state: combine partial attentions over disjoint key sets by their LSE (natural
log), two at a time (cascade: shared prefix + own suffix) or K at a time (the split-KV
reduce of decode and of a cascade's split prefix).

For states (v_i, s_i): s = log(sum_i exp(s_i)), v = sum_i exp(s_i - s) v_i. An empty
state has s = -inf and weighs nothing; if all are empty the result is v = 0, s = -inf.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _merge_state_kernel(VA, SA, VB, SB, VOut, SOut, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM
    s_a = tl.load(SA + row)
    s_b = tl.load(SB + row)
    m = tl.maximum(s_a, s_b)
    m = tl.where(m == float("-inf"), 0.0, m)
    w_a = tl.exp(s_a - m)
    w_b = tl.exp(s_b - m)
    total = w_a + w_b
    v_a = tl.load(VA + row * HEAD_DIM + d, mask=d_ok, other=0.0).to(tl.float32)
    v_b = tl.load(VB + row * HEAD_DIM + d, mask=d_ok, other=0.0).to(tl.float32)
    empty = total == 0.0
    safe = tl.where(empty, 1.0, total)
    v = (v_a * w_a + v_b * w_b) / safe
    tl.store(VOut + row * HEAD_DIM + d, v.to(VOut.dtype.element_ty), mask=d_ok)
    tl.store(SOut + row, tl.where(empty, float("-inf"), m + tl.log(safe)))


@triton.jit
def _merge_states_kernel(V, S, VOut, SOut, num_states, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM
    m = float("-inf")
    total = 0.0
    acc = tl.zeros([BLOCK_D], tl.float32)
    for k in range(0, num_states):
        s = tl.load(S + row * num_states + k)
        if s > float("-inf"):
            v = tl.load(V + (row * num_states + k) * HEAD_DIM + d, mask=d_ok, other=0.0).to(tl.float32)
            m_new = tl.maximum(m, s)
            alpha = tl.exp(m - m_new)
            w = tl.exp(s - m_new)
            acc = acc * alpha + v * w
            total = total * alpha + w
            m = m_new
    empty = total == 0.0
    safe = tl.where(empty, 1.0, total)
    tl.store(VOut + row * HEAD_DIM + d, (acc / safe).to(VOut.dtype.element_ty), mask=d_ok)
    tl.store(SOut + row, tl.where(empty, float("-inf"), m + tl.log(safe)))


def _block_d(head_dim: int) -> int:
    return triton.next_power_of_2(head_dim)


def merge_state(v_a, s_a, v_b, s_b, out_dtype=None) -> tuple[torch.Tensor, torch.Tensor]:
    """``v_*`` [N, H, D], ``s_*`` [N, H] fp32 -> merged (v [N, H, D], s [N, H] fp32)."""
    v_a, v_b, s_a, s_b = (t.contiguous() for t in (v_a, v_b, s_a, s_b))
    v = torch.empty(v_a.shape, dtype=out_dtype or v_a.dtype, device=v_a.device)
    s = torch.empty(s_a.shape, dtype=torch.float32, device=v_a.device)
    rows = s_a.numel()
    if rows:
        head_dim = v_a.shape[-1]
        _merge_state_kernel[(rows,)](v_a, s_a, v_b, s_b, v, s, HEAD_DIM=head_dim, BLOCK_D=_block_d(head_dim))
    return v, s


def merge_states(v, s, out_dtype=None) -> tuple[torch.Tensor, torch.Tensor]:
    """``v`` [N, H, K, D], ``s`` [N, H, K] fp32 -> merged (v [N, H, D], s [N, H] fp32)."""
    v, s = v.contiguous(), s.contiguous()
    n, h, k, head_dim = v.shape
    out = torch.empty((n, h, head_dim), dtype=out_dtype or v.dtype, device=v.device)
    lse = torch.empty((n, h), dtype=torch.float32, device=v.device)
    if n * h:
        _merge_states_kernel[(n * h,)](v, s, out, lse, k, HEAD_DIM=head_dim, BLOCK_D=_block_d(head_dim))
    return out, lse
