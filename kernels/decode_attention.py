"""Decode attention: one query per request over its paged context, split-KV.

Stage 1 gives each (request, KV head, split) program a contiguous slice of the context
and all the query heads of that KV head (GQA packed into one tile, padded to the 16 rows
``tl.dot`` needs); it writes a partial output and LSE. Stage 2 is ``merge_states``. The
split count comes from the batch shape: enough programs to fill the GPU twice over, but
no split shorter than four KV blocks.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from kernels.merge_state import merge_states
from kernels.online_softmax import LOG2E, attend_block, finish
from kernels.tuning import Blocks, blocks_for, upcast_loads

MAX_SPLITS = 64


@triton.jit
def _decode_split_kernel(
    Q, KCache, VCache, Mid, MidLse, PageTable, SeqLens, KvStarts, num_splits,
    stride_qb, stride_qh, stride_ct, stride_ch, stride_pt, sm_scale_log2, window,
    SLIDING: tl.constexpr,
    GROUP: tl.constexpr, BLOCK_H: tl.constexpr, PAGE: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    b = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(SeqLens + b)
    kv_start = tl.load(KvStarts + b)
    if SLIDING:  # the query at seq_len - 1 sees the window's keys: its context starts there
        kv_start = tl.maximum(kv_start, seq_len - window)
    split_len = tl.cdiv(tl.cdiv(seq_len - kv_start, num_splits), BLOCK_N) * BLOCK_N
    lo = kv_start + split * split_len
    hi = tl.minimum(lo + split_len, seq_len)

    h = tl.arange(0, BLOCK_H)
    head = kv_head * GROUP + h
    h_ok = h < GROUP
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM
    q = tl.load(
        Q + b * stride_qb + head[:, None] * stride_qh + d[None, :],
        mask=h_ok[:, None] & d_ok[None, :],
        other=0.0,
    )
    if UPCAST:
        q = q.to(tl.float32)
    page_row = PageTable + b * stride_pt
    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
    for start in range(lo - lo % BLOCK_N, hi, BLOCK_N):  # aligned, for block gathers
        acc, m_i, l_i = attend_block(
            acc, m_i, l_i, q, h, start, lo, hi, KCache, VCache, page_row, kv_head,
            stride_ct, stride_ch, sm_scale_log2, d, d_ok, 0, PAGE, BLOCK_N, False, False, UPCAST, PRECISION,
        )  # fmt: skip
    out, lse = finish(acc, m_i, l_i)
    # Mid [B, H, splits, D] and MidLse [B, H, splits], contiguous.
    row = (b * (GROUP * tl.num_programs(1)) + head) * num_splits + split
    tl.store(Mid + row[:, None] * HEAD_DIM + d[None, :], out, mask=h_ok[:, None] & d_ok[None, :])
    tl.store(MidLse + row, lse, mask=h_ok)


def choose_num_splits(batch: int, num_kv_heads: int, max_kv_len: int, blocks: Blocks) -> int:
    """Fill ``2 * sm_count`` programs, never splitting below four KV blocks per split."""
    want = triton.cdiv(2 * blocks.sm_count, max(1, batch * num_kv_heads))
    cap = triton.cdiv(max(1, max_kv_len), 4 * blocks.decode_n)
    return max(1, min(want, cap, MAX_SPLITS))


def decode_attention(
    q, k_cache, v_cache, page_table, seq_lens, page_size,
    *, kv_starts=None, max_kv_len=None, num_splits=None, sm_scale=None, return_lse=False, out_dtype=None,
    window=None,
):  # fmt: skip
    """``q`` [B, H, D], each request's query at position ``seq_len - 1`` (its K/V already
    written); attends context ``[kv_start, seq_len)``, or its last ``window`` positions.
    Returns ``out`` [B, H, D] (and ``lse`` [B, H])."""
    batch, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[1]
    group = num_heads // num_kv_heads
    blocks = blocks_for(q.device, head_dim)
    seq_lens = seq_lens.to(device=q.device, dtype=torch.int32)
    if kv_starts is None:
        kv_starts = torch.zeros_like(seq_lens)
    if num_splits is None:
        longest = max_kv_len if max_kv_len is not None else int(seq_lens.max().item()) if batch else 0
        longest = min(longest, window) if window is not None else longest
        num_splits = choose_num_splits(batch, num_kv_heads, longest, blocks)
    mid = torch.empty((batch, num_heads, num_splits, head_dim), dtype=torch.float32, device=q.device)
    mid_lse = torch.empty((batch, num_heads, num_splits), dtype=torch.float32, device=q.device)
    scale = sm_scale if sm_scale is not None else 1.0 / math.sqrt(head_dim)
    upcast = upcast_loads(q.dtype)
    if batch:
        _decode_split_kernel[(batch, num_kv_heads, num_splits)](
            q, k_cache, v_cache, mid, mid_lse, page_table, seq_lens, kv_starts.to(seq_lens), num_splits,
            q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), page_table.stride(0),
            scale * LOG2E, window or 0,
            SLIDING=window is not None,
            GROUP=group, BLOCK_H=max(16, triton.next_power_of_2(group)), PAGE=page_size, HEAD_DIM=head_dim,
            BLOCK_D=max(16, triton.next_power_of_2(head_dim)), BLOCK_N=blocks.decode_n,
            UPCAST=upcast, PRECISION="ieee" if upcast else "tf32",
            num_warps=4, num_stages=blocks.num_stages,
        )  # fmt: skip
    out, lse = merge_states(mid, mid_lse, out_dtype=out_dtype or q.dtype)
    return (out, lse) if return_lse else out
