"""Cascade (shared-prefix) attention: the prefix shared by a group of requests is read once
for all their queries, then merged with each request's own suffix attention by LSE.

Plain paged attention reads a 32k-token shared prefix once per request; here each KV tile
of the prefix is read once per ``BLOCK_M`` query rows of the whole group, turning a
bandwidth-bound sweep into a matmul. The prefix pass reuses the extend kernel with work
items that carry no causal part, split along the prefix so the GPU stays full; the pieces
and the suffix are combined with ``merge_states`` and ``merge_state``.

A group is (member request indices, shared tokens): the members' page rows hold the same
pages for the first ``shared`` tokens, which the engine's radix cache guarantees for
requests whose cached prefixes match.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton

from kernels.decode_attention import MAX_SPLITS, decode_attention
from kernels.extend_attention import ITEM_FIELDS, extend_attention_items, make_extend_items
from kernels.merge_state import merge_state, merge_states
from kernels.tuning import blocks_for


@dataclass
class CascadePlan:
    """Everything host-side, built once per forward and reused by every layer."""

    decode_only: bool
    kv_starts: torch.Tensor  # [B] int32, where each request's own attention starts
    seq_lens: torch.Tensor  # [B] int32
    max_seq_len: int
    suffix_items: torch.Tensor
    max_q_len: int
    shared_rows: torch.Tensor  # [Nq] long, query rows of all group members, group by group
    shared_items: torch.Tensor
    max_group_rows: int
    num_splits: int


def plan_cascade(q, k_cache, q_lens, prefix_lens, groups) -> CascadePlan:
    """Work items for the suffixes and for each group's prefix, split along the prefix
    until the launch fills twice the GPU's SMs (no piece under four KV blocks)."""
    num_kv_heads, device = k_cache.shape[1], q.device
    group_size = q.shape[1] // num_kv_heads
    blocks = blocks_for(device, q.shape[2])
    kv_starts = [0] * len(q_lens)
    for members, shared in groups:
        for b in members:
            kv_starts[b] = shared
    row_start = [0]
    for n in q_lens:
        row_start.append(row_start[-1] + int(n))
    tiles = sum(
        triton.cdiv(sum(int(q_lens[b]) for b in members) * group_size, blocks.extend_m)
        for members, _ in groups
    )
    want = triton.cdiv(2 * blocks.sm_count, max(1, tiles * num_kv_heads))
    shared_rows, items, num_splits, g_start = [], [], 1, 0
    for members, shared in groups:
        rows = [r for b in members for r in range(row_start[b], row_start[b + 1])]
        splits = max(1, min(want, triton.cdiv(shared, 4 * blocks.extend_n), MAX_SPLITS))
        piece = triton.cdiv(shared, splits)
        for s in range(splits):
            lo, hi = s * piece, min(shared, (s + 1) * piece)
            items.append((g_start, len(rows), g_start, s, lo, hi, hi, members[0]))
        num_splits = max(num_splits, splits)
        shared_rows.extend(rows)
        g_start += len(rows)
    suffix_items, max_q_len = make_extend_items(q_lens, prefix_lens, kv_starts, device)
    seq_lens = [int(p) + int(n) for p, n in zip(prefix_lens, q_lens)]
    return CascadePlan(
        decode_only=all(int(n) == 1 for n in q_lens),
        kv_starts=torch.tensor(kv_starts, dtype=torch.int32, device=device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        max_seq_len=max(seq_lens, default=0),
        suffix_items=suffix_items,
        max_q_len=max_q_len,
        shared_rows=torch.tensor(shared_rows, dtype=torch.long, device=device),
        shared_items=torch.tensor(items, dtype=torch.int32, device=device).reshape(-1, len(ITEM_FIELDS)),
        max_group_rows=max((r for _, r, *_ in items), default=0),
        num_splits=num_splits,
    )


def decode_plan(kv_starts: torch.Tensor, seq_lens: torch.Tensor, max_seq_len: int) -> CascadePlan:
    """A pure decode batch whose lengths live in device buffers (``seq_lens`` [B] int32,
    ``kv_starts`` [B] int32) that a CUDA graph reads at each replay: nothing here depends
    on their values, and the split count comes from ``max_seq_len``, the longest context
    the plan serves (a shorter one leaves splits empty), so one launch grid fits every
    replay."""
    empty = torch.empty((0, len(ITEM_FIELDS)), dtype=torch.int32, device=seq_lens.device)
    return CascadePlan(
        decode_only=True, kv_starts=kv_starts, seq_lens=seq_lens, max_seq_len=max_seq_len,
        suffix_items=empty, max_q_len=1, shared_rows=torch.empty(0, dtype=torch.long, device=seq_lens.device),
        shared_items=empty, max_group_rows=0, num_splits=1,
    )  # fmt: skip


def cascade_attention_planned(
    q, k_cache, v_cache, page_table, page_size, plan: CascadePlan, sm_scale=None, window=None
):
    """Returns (out [T, H, D] in q's dtype, lse [T, H] fp32). Without groups this is plain
    extend (or split-KV decode) attention; with groups the suffix output stays fp32 until
    the merge. A sliding-window layer (``window``) takes a plan without groups: a shared
    prefix is not one set of keys for queries whose windows differ."""
    num_rows, num_heads, head_dim = q.shape
    rows = plan.shared_rows
    grouped = rows.numel() > 0
    if grouped and window is not None:
        raise ValueError("a sliding-window layer's plan has no shared-prefix groups")
    out_dtype = torch.float32 if grouped else q.dtype
    if plan.decode_only:
        out, lse = decode_attention(
            q, k_cache, v_cache, page_table, plan.seq_lens, page_size, kv_starts=plan.kv_starts,
            max_kv_len=plan.max_seq_len, sm_scale=sm_scale, return_lse=True, out_dtype=out_dtype,
            window=window,
        )  # fmt: skip
    else:
        out = torch.empty(q.shape, dtype=out_dtype, device=q.device)
        lse = torch.empty((num_rows, num_heads), dtype=torch.float32, device=q.device)
        extend_attention_items(
            q,
            k_cache,
            v_cache,
            page_table,
            page_size,
            plan.suffix_items,
            plan.max_q_len,
            out,
            lse,
            sm_scale,
            chunks=True,
            window=window,
        )
    if not grouped:
        return out, lse
    shape = (rows.numel(), num_heads, plan.num_splits, head_dim)
    pieces = torch.empty(shape, dtype=torch.float32, device=q.device)
    # Groups with fewer pieces than the widest leave slots unwritten: mark those empty.
    pieces_lse = torch.full(pieces.shape[:3], float("-inf"), dtype=torch.float32, device=q.device)
    extend_attention_items(
        q[rows], k_cache, v_cache, page_table, page_size, plan.shared_items, plan.max_group_rows,
        pieces, pieces_lse, sm_scale,
    )  # fmt: skip
    shared_out, shared_lse = merge_states(pieces, pieces_lse)
    out[rows], lse[rows] = merge_state(out[rows], lse[rows], shared_out, shared_lse)
    return out.to(q.dtype), lse


def cascade_attention(
    q,
    k_cache,
    v_cache,
    page_table,
    q_lens,
    prefix_lens,
    page_size,
    groups,
    *,
    sm_scale=None,
    return_lse=False,
):
    """Attention of a ragged batch (new K/V already written) with each group's shared
    prefix attended once; equal to ``extend_attention`` on the same batch."""
    plan = plan_cascade(q, k_cache, q_lens, prefix_lens, groups)
    out, lse = cascade_attention_planned(q, k_cache, v_cache, page_table, page_size, plan, sm_scale)
    return (out, lse) if return_lse else out
