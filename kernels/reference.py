"""Torch references for every kernel: plain loops over requests, any dtype (float64 in
the tests), and the engine's CPU attention path.

Shapes shared by all kernels:
  q          [T, H, D]       new tokens of all requests, concatenated in request order
  k/v cache  [S, Hkv, D]     flat token slots; slot = page * page_size + offset
  page_table [B, max_pages]  int, the pages of each request in sequence order
  lse        [T, H]          natural-log sum of exp of the scaled scores (-inf: no keys)
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F


def context_slots(page_row: torch.Tensor, start: int, stop: int, page_size: int) -> torch.Tensor:
    """Flat KV slots of positions ``[start, stop)`` of one request."""
    pos = torch.arange(start, stop, device=page_row.device)
    return page_row[pos // page_size].long() * page_size + pos % page_size


def kv_write_ref(k_cache, v_cache, k, v, slot_mapping) -> None:
    """Scatter new K/V into their slots; a negative slot is padding and is skipped."""
    keep = slot_mapping >= 0
    k_cache[slot_mapping[keep]] = k[keep].to(k_cache.dtype)
    v_cache[slot_mapping[keep]] = v[keep].to(v_cache.dtype)


def attend_ref(
    queries, q_pos, k_cache, v_cache, page_row, kv_start, kv_end, page_size, scale, with_lse=True, window=None
):
    """Queries [n, H, D] at positions ``q_pos`` [n] over context positions
    ``[kv_start, kv_end)`` of one page row, causal (a key after its query is masked); with a
    ``window``, a query at ``p`` sees only keys after ``p - window`` (transformers' sliding
    window: itself and the ``window - 1`` before it). Keys before the lowest position any
    query sees are never read.
    Without ``with_lse`` (the engine's CPU path) SDPA computes the same output faster;
    every query must then see at least one key."""
    group = queries.shape[1] // k_cache.shape[1]
    if window is not None:  # a window's dropped pages may hold anything: read from its start
        kv_start = max(kv_start, int(q_pos.min()) - window + 1)
    slots = context_slots(page_row, kv_start, kv_end, page_size)
    keys = k_cache[slots].to(queries.dtype).transpose(0, 1).repeat_interleave(group, dim=0)
    values = v_cache[slots].to(queries.dtype).transpose(0, 1).repeat_interleave(group, dim=0)
    k_pos = torch.arange(kv_start, kv_end, device=queries.device)
    visible = k_pos[None, :] <= q_pos[:, None]  # [n, keys]
    if window is not None:
        visible &= k_pos[None, :] > q_pos[:, None] - window
    if not with_lse:
        out = F.scaled_dot_product_attention(
            queries.transpose(0, 1), keys, values, attn_mask=visible, scale=scale
        )
        return out.transpose(0, 1), None
    scores = queries.transpose(0, 1) @ keys.transpose(1, 2) * scale  # [H, n, keys]
    scores = scores.masked_fill(~visible[None], -math.inf)
    lse = torch.logsumexp(scores, dim=-1)  # [H, n]
    probs = torch.exp(scores - lse[..., None]).nan_to_num(0.0)
    return (probs @ values).transpose(0, 1), lse.transpose(0, 1)


def _lse_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def extend_attention_ref(
    q,
    k_cache,
    v_cache,
    page_table,
    q_lens,
    prefix_lens,
    page_size,
    kv_starts=None,
    sm_scale=None,
    with_lse=True,
    window=None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Each request's ``q_len`` queries sit at positions ``prefix_len + i``; they attend to
    positions ``[kv_start, prefix_len)`` without a mask and to ``[prefix_len, prefix_len + i]``
    (within the ``window`` before each query, where one is given)."""
    scale = sm_scale if sm_scale is not None else 1.0 / math.sqrt(q.shape[-1])
    out = torch.zeros_like(q)
    lse = torch.full(q.shape[:2], -math.inf, dtype=_lse_dtype(q.dtype), device=q.device) if with_lse else None
    starts = kv_starts if kv_starts is not None else [0] * len(q_lens)
    t0 = 0
    for b, (q_len, prefix, kv_start) in enumerate(zip(q_lens, prefix_lens, starts)):
        q_len, prefix = int(q_len), int(prefix)
        rows = slice(t0, t0 + q_len)
        q_pos = torch.arange(prefix, prefix + q_len, device=q.device)
        o, s = attend_ref(
            q[rows],
            q_pos,
            k_cache,
            v_cache,
            page_table[b],
            int(kv_start),
            prefix + q_len,
            page_size,
            scale,
            with_lse,
            window,
        )
        out[rows] = o
        if with_lse:
            lse[rows] = s.to(lse.dtype)
        t0 += q_len
    return out, lse


def decode_attention_ref(
    q, k_cache, v_cache, page_table, seq_lens, page_size, kv_starts=None, sm_scale=None, window=None
):
    """One query per request, at position ``seq_len - 1``, its own K/V already written."""
    ones = [1] * len(seq_lens)
    prefix = [int(s) - 1 for s in seq_lens]
    return extend_attention_ref(
        q, k_cache, v_cache, page_table, ones, prefix, page_size, kv_starts, sm_scale, window=window
    )


def merge_state_ref(v_a, s_a, v_b, s_b) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention over the union of two disjoint key sets, from each set's output and LSE."""
    s = torch.logaddexp(s_a, s_b)
    w_a = torch.exp(s_a - s).nan_to_num(0.0)[..., None]
    w_b = torch.exp(s_b - s).nan_to_num(0.0)[..., None]
    return (v_a * w_a + v_b * w_b).to(v_a.dtype), s


def merge_states_ref(v, s) -> tuple[torch.Tensor, torch.Tensor]:
    """K-way merge: ``v`` [N, H, K, D], ``s`` [N, H, K] -> [N, H, D], [N, H]."""
    total = torch.logsumexp(s, dim=-1)
    w = torch.exp(s - total[..., None]).nan_to_num(0.0)
    return (v * w[..., None]).sum(dim=2), total


def cascade_attention_ref(
    q, k_cache, v_cache, page_table, q_lens, prefix_lens, page_size, groups, sm_scale=None
):
    """The cascade decomposition: each group's shared prefix attended once by all its
    queries together, each request's suffix alone, merged by LSE. ``groups`` holds
    (request indices, shared tokens); members' page rows agree on the shared pages."""
    scale = sm_scale if sm_scale is not None else 1.0 / math.sqrt(q.shape[-1])
    kv_starts = [0] * len(q_lens)
    for members, shared in groups:
        for b in members:
            kv_starts[b] = shared
    out, lse = extend_attention_ref(
        q, k_cache, v_cache, page_table, q_lens, prefix_lens, page_size, kv_starts, scale
    )
    row_start = [0]
    for n in q_lens:
        row_start.append(row_start[-1] + int(n))
    for members, shared in groups:
        rows = torch.cat([torch.arange(row_start[b], row_start[b + 1]) for b in members])
        every_key = torch.full((len(rows),), shared, device=q.device)
        v_sh, s_sh = attend_ref(
            q[rows], every_key, k_cache, v_cache, page_table[members[0]], 0, shared, page_size, scale
        )
        out[rows], lse[rows] = merge_state_ref(out[rows], lse[rows], v_sh, s_sh.to(lse.dtype))
    return out, lse


def silu_and_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """A SwiGLU MLP's product of its gate and up projections."""
    return F.silu(gate) * up


def fused_moe_ref(x, gate_up, down, topk_weights, topk_ids, glu=silu_and_mul, gate_up_bias=None,
                  down_bias=None) -> torch.Tensor:  # fmt: skip
    """Each token through each of its experts, one at a time: ``sum_j w_j * (down_e glu(gate_e
    x + b, up_e x + b) + b)`` with ``e = topk_ids[t, j]``, in ``x``'s dtype (float64 in the
    tests)."""
    inter = down.shape[2]
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for j in range(topk_ids.shape[1]):
            e = int(topk_ids[t, j])
            h = gate_up[e].to(x.dtype) @ x[t]
            if gate_up_bias is not None:
                h = h + gate_up_bias[e].to(x.dtype)
            y = down[e].to(x.dtype) @ glu(h[:inter], h[inter:])
            if down_bias is not None:
                y = y + down_bias[e].to(x.dtype)
            out[t] += topk_weights[t, j].to(x.dtype) * y
    return out


def attention_sinks_ref(out: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor) -> torch.Tensor:
    """Attention sinks (gpt-oss): a learned logit per head that joins the softmax and brings
    no value. That is the attention merged with a state of value 0 and LSE ``sinks``, so
    ``out * sigmoid(lse - sink)`` (``out`` [T, H, D], ``lse`` [T, H] natural log)."""
    return (out.float() * torch.sigmoid(lse.float() - sinks.float()[None, :])[..., None]).to(out.dtype)
