"""The online-softmax step every attention kernel here shares: one block of paged keys
and values folded into a running (max, sum, accumulator) state.

Scores are kept in log2 units (``sm_scale * log2(e)`` applied once) so ``exp2`` does the
exponentials; ``finish`` converts the state's LSE back to natural log for callers.
"""

from __future__ import annotations

import triton
import triton.language as tl

LOG2E = 1.4426950408889634


@triton.jit
def block_slots(page_row, start, lo, hi, PAGE: tl.constexpr, BLOCK_N: tl.constexpr):
    """The KV slots of context positions ``[start, start + BLOCK_N)``, ``start`` a multiple
    of ``BLOCK_N``, gathered by page rather than by slot: where a page holds the block (both
    powers of two, ``PAGE >= BLOCK_N``) one page-table read and a contiguous run of slots;
    otherwise one read per page, ``BLOCK_N // PAGE`` runs of ``PAGE``. Pages wholly outside
    ``[lo, hi)`` are not read (a window's dropped pages may hold nothing)."""
    if PAGE >= BLOCK_N:
        page = tl.load(page_row + start // PAGE).to(tl.int64)
        slots = page * PAGE + start % PAGE + tl.arange(0, BLOCK_N)
    else:
        index = start // PAGE + tl.arange(0, BLOCK_N // PAGE)
        held = (index * PAGE < hi) & ((index + 1) * PAGE > lo)
        pages = tl.load(page_row + index, mask=held, other=0).to(tl.int64)
        slots = tl.reshape(pages[:, None] * PAGE + tl.arange(0, PAGE)[None, :], [BLOCK_N])
    return slots


@triton.jit
def attend_block(
    acc, m_i, l_i, q, q_pos, start, lo, hi,
    KCache, VCache, page_row, kv_head, stride_ct, stride_ch, sm_scale_log2, d, d_ok, window,
    PAGE: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr, SLIDING: tl.constexpr,
    UPCAST: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    """Fold the keys at context positions ``[start, start + BLOCK_N)`` that lie in
    ``[lo, hi)`` into the state of the query rows ``q``; ``start`` is a multiple of
    ``BLOCK_N`` (callers align their loops down; ``lo`` masks what precedes the range). With
    CAUSAL, a key after a row's position ``q_pos`` is masked; with SLIDING, a key at or
    before ``q_pos - window`` too (transformers' sliding window)."""
    pos = start + tl.arange(0, BLOCK_N)
    kv_ok = (pos >= lo) & (pos < hi)
    slot = block_slots(page_row, start, lo, hi, PAGE, BLOCK_N)
    offs = slot[:, None] * stride_ct + kv_head * stride_ch + d[None, :]
    kv_mask = kv_ok[:, None] & d_ok[None, :]
    k = tl.load(KCache + offs, mask=kv_mask, other=0.0)
    v = tl.load(VCache + offs, mask=kv_mask, other=0.0)
    if UPCAST:
        k = k.to(tl.float32)
        v = v.to(tl.float32)
    qk = tl.dot(q, tl.trans(k), input_precision=PRECISION) * sm_scale_log2
    keep = kv_ok[None, :]
    if CAUSAL:
        keep = keep & (pos[None, :] <= q_pos[:, None])
    if SLIDING:
        keep = keep & (pos[None, :] > q_pos[:, None] - window)
    qk = tl.where(keep, qk, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(qk, 1))
    # A row that has seen no key yet keeps max -inf; subtract 0 instead so exp2 gives 0, not NaN.
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.math.exp2(qk - m_safe[:, None])
    alpha = tl.math.exp2(m_i - m_safe)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
    return acc, m_new, l_i


@triton.jit
def finish(acc, m_i, l_i):
    """Normalized output and natural-log LSE; a row with no keys gives 0 and -inf."""
    empty = l_i == 0.0
    l_safe = tl.where(empty, 1.0, l_i)
    out = acc / l_safe[:, None]
    lse = tl.where(empty, float("-inf"), (m_i + tl.math.log2(l_safe)) * 0.6931471805599453)  # x ln 2
    return out, lse
