"""Extend attention: each request's chunk of new queries attends to its paged prefix (no
mask) and to itself (causal) in one online-softmax pass; a tile masks only the key blocks
on its diagonal. Decodes ride along as chunks of length one (no masked block at all).

The launch is driven by *work items*, one row of ``ITEM_FIELDS`` per item: which query
rows, which context range, where the output goes. A plain batch has one item per request;
cascade attention (``cascade.py``) reuses the kernel with items that attend a shared
prefix split into pieces, writing each piece to its own output slot. GQA: a tile's
``BLOCK_M`` rows are (token, query head of the KV head) pairs, so each K/V tile is loaded
once for all the query heads that share it.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from kernels.online_softmax import LOG2E, attend_block, finish
from kernels.tuning import ExtendTile, blocks_for, chunk_tile, upcast_loads

# q rows [q_start, q_start + q_len) sit at positions prefix_end + i; they attend to
# [kv_start, prefix_end) unmasked and [prefix_end, kv_end) causally; output rows start at
# out_start in output slot out_split; the page row is page_table[table_row].
ITEM_FIELDS = ("q_start", "q_len", "out_start", "out_split", "kv_start", "prefix_end", "kv_end", "table_row")


@triton.jit
def _extend_kernel(
    Q, KCache, VCache, Out, Lse, PageTable, Items,
    stride_qt, stride_qh, stride_ct, stride_ch,
    stride_ot, stride_oh, stride_os, stride_lt, stride_lh, stride_ls, stride_pt,
    sm_scale_log2, window,
    SLIDING: tl.constexpr,
    GROUP: tl.constexpr, PAGE: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    UPCAST: tl.constexpr, PRECISION: tl.constexpr, HAS_LSE: tl.constexpr,
):  # fmt: skip
    item = Items + tl.program_id(0) * 8
    kv_head = tl.program_id(1)
    pid_m = tl.program_id(2)
    q_start = tl.load(item + 0)
    q_len = tl.load(item + 1)
    if pid_m * BLOCK_M >= q_len * GROUP:
        return
    out_start = tl.load(item + 2)
    out_split = tl.load(item + 3)
    kv_start = tl.load(item + 4)
    prefix_end = tl.load(item + 5)
    kv_end = tl.load(item + 6)
    page_row = PageTable + tl.load(item + 7).to(tl.int64) * stride_pt

    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    tok = rows // GROUP
    head = kv_head * GROUP + rows % GROUP
    row_ok = tok < q_len
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM
    q_offs = (q_start + tok).to(tl.int64)[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :]
    q = tl.load(Q + q_offs, mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    if UPCAST:
        q = q.to(tl.float32)
    q_pos = prefix_end + tok

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    # Every key before the tile's first query position is visible to all its rows: the
    # prefix and the chunk's own keys up to that point run unmasked, and only the few
    # blocks on the tile's diagonal pay for the causal mask. (A cascade item has no chunk
    # part: kv_end == prefix_end bounds it.) Loops start on multiples of BLOCK_N, so each
    # block's pages are gathered whole (``block_slots``).
    first_tok = (pid_m * BLOCK_M) // GROUP
    open_end = tl.minimum(prefix_end + first_tok + 1, kv_end)
    if SLIDING:  # nothing before the tile's first query's window is read
        kv_start = tl.maximum(kv_start, prefix_end + first_tok - window + 1)
    lo = kv_start - kv_start % BLOCK_N
    open_aligned = tl.maximum(lo, open_end - open_end % BLOCK_N)
    for start in range(lo, open_aligned, BLOCK_N):
        acc, m_i, l_i = attend_block(
            acc, m_i, l_i, q, q_pos, start, kv_start, open_aligned, KCache, VCache, page_row, kv_head,
            stride_ct, stride_ch, sm_scale_log2, d, d_ok, window, PAGE, BLOCK_N, False, SLIDING, UPCAST,
            PRECISION,
        )  # fmt: skip
    # The diagonal, causally, up to the last query row of this tile.
    last_tok = tl.minimum((pid_m * BLOCK_M + BLOCK_M - 1) // GROUP, q_len - 1)
    self_end = tl.minimum(kv_end, prefix_end + last_tok + 1)
    for start in range(open_aligned, self_end, BLOCK_N):
        acc, m_i, l_i = attend_block(
            acc, m_i, l_i, q, q_pos, start, kv_start, self_end, KCache, VCache, page_row, kv_head,
            stride_ct, stride_ch, sm_scale_log2, d, d_ok, window, PAGE, BLOCK_N, True, SLIDING, UPCAST,
            PRECISION,
        )  # fmt: skip

    out, lse = finish(acc, m_i, l_i)
    out_rows = (out_start + tok).to(tl.int64)
    o_offs = out_rows[:, None] * stride_ot + head[:, None] * stride_oh + out_split * stride_os + d[None, :]
    tl.store(Out + o_offs, out.to(Out.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])
    if HAS_LSE:
        tl.store(Lse + out_rows * stride_lt + head * stride_lh + out_split * stride_ls, lse, mask=row_ok)


def make_extend_items(q_lens, prefix_lens, kv_starts=None, device="cpu") -> tuple[torch.Tensor, int]:
    """One work item per request of a plain ragged batch; returns (items, longest chunk)."""
    rows, q_start = [], 0
    starts = kv_starts if kv_starts is not None else [0] * len(q_lens)
    for b, (q_len, prefix, kv_start) in enumerate(zip(q_lens, prefix_lens, starts)):
        q_len, prefix = int(q_len), int(prefix)
        rows.append((q_start, q_len, q_start, 0, int(kv_start), prefix, prefix + q_len, b))
        q_start += q_len
    items = torch.tensor(rows, dtype=torch.int32).reshape(-1, len(ITEM_FIELDS)).to(device)
    return items, max((int(n) for n in q_lens), default=0)


def extend_attention_items(
    q, k_cache, v_cache, page_table, page_size, items, max_q_len, out, lse=None, sm_scale=None, chunks=False,
    window=None,
) -> None:  # fmt: skip
    """Run ``items`` (see ``ITEM_FIELDS``). ``out`` is [rows, H, D] or [rows, H, splits, D]
    and ``lse`` the matching [rows, H(, splits)] fp32 tensor, or None. ``chunks``: plain
    prefill chunks, whose best tile differs from cascade's and by shape (``tuning.chunk_tile``).
    ``window``: each query sees the ``window`` keys up to itself (a sliding-window layer)."""
    num_heads, head_dim = q.shape[1], q.shape[2]
    num_kv_heads = k_cache.shape[1]
    group = num_heads // num_kv_heads
    if items.shape[0] == 0 or max_q_len == 0:
        return
    scale = sm_scale if sm_scale is not None else 1.0 / math.sqrt(head_dim)
    split_o = out.stride(2) if out.dim() == 4 else 0
    has_lse = lse is not None
    lse_t = lse if has_lse else out
    lse_strides = (
        (lse.stride(0), lse.stride(1), lse.stride(2) if lse.dim() == 3 else 0) if has_lse else (0, 0, 0)
    )
    upcast = upcast_loads(q.dtype)
    if chunks:
        tile = chunk_tile(q.device, head_dim, max_q_len, upcast)
    else:
        blocks = blocks_for(q.device, head_dim)
        tile = ExtendTile(blocks.extend_m, blocks.extend_n, blocks.num_warps, blocks.num_stages)
    grid = (items.shape[0], num_kv_heads, triton.cdiv(max_q_len * group, tile.extend_m))
    _extend_kernel[grid](
        q, k_cache, v_cache, out, lse_t, page_table, items,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1),
        out.stride(0), out.stride(1), split_o, *lse_strides, page_table.stride(0),
        scale * LOG2E, window or 0,
        SLIDING=window is not None,
        GROUP=group, PAGE=page_size, HEAD_DIM=head_dim, BLOCK_D=max(16, triton.next_power_of_2(head_dim)),
        BLOCK_M=tile.extend_m, BLOCK_N=tile.extend_n,
        UPCAST=upcast, PRECISION="ieee" if upcast else "tf32", HAS_LSE=has_lse,
        num_warps=tile.warps, num_stages=tile.stages,
    )  # fmt: skip


def extend_attention(
    q, k_cache, v_cache, page_table, q_lens, prefix_lens, page_size,
    *, kv_starts=None, sm_scale=None, return_lse=False, window=None,
):  # fmt: skip
    """Ragged extend over paged KV (the new tokens' K/V already written). ``q`` [T, H, D];
    returns ``out`` [T, H, D] (and ``lse`` [T, H] natural log when asked); ``window``: a
    sliding-window layer's."""
    items, max_q_len = make_extend_items(q_lens, prefix_lens, kv_starts, q.device)
    out = torch.empty_like(q)
    lse = torch.empty(q.shape[:2], dtype=torch.float32, device=q.device) if return_lse else None
    extend_attention_items(
        q,
        k_cache,
        v_cache,
        page_table,
        page_size,
        items,
        max_q_len,
        out,
        lse,
        sm_scale,
        chunks=True,
        window=window,
    )
    return (out, lse) if return_lse else out
