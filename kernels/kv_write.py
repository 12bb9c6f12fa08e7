"""KV write: scatter the new tokens' K and V into their pages, both in one launch.

One program copies one token's ``Hkv * D`` contiguous elements (a slice of them for wide
models); a negative slot marks padding and is skipped, as in vLLM's slot mappings.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 1024


@triton.jit
def _kv_write_kernel(
    K, V, KCache, VCache, Slots,
    stride_kt, stride_vt, stride_ct,
    ROW: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    t = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    slot = tl.load(Slots + t).to(tl.int64)
    if slot >= 0:
        mask = offs < ROW
        k = tl.load(K + t * stride_kt + offs, mask=mask)
        v = tl.load(V + t * stride_vt + offs, mask=mask)
        tl.store(KCache + slot * stride_ct + offs, k.to(KCache.dtype.element_ty), mask=mask)
        tl.store(VCache + slot * stride_ct + offs, v.to(VCache.dtype.element_ty), mask=mask)


def kv_write(
    k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor
):
    """``k``/``v`` [T, Hkv, D] into ``k_cache``/``v_cache`` [S, Hkv, D] at ``slots`` [T]."""
    num_tokens = k.shape[0]
    if num_tokens == 0:
        return
    if k.stride(2) != 1 or k.stride(1) != k.shape[2] or v.stride(2) != 1 or v.stride(1) != v.shape[2]:
        k, v = k.contiguous(), v.contiguous()
    row = k.shape[1] * k.shape[2]
    block = min(BLOCK, triton.next_power_of_2(row))
    _kv_write_kernel[(num_tokens, triton.cdiv(row, block))](
        k, v, k_cache, v_cache, slots, k.stride(0), v.stride(0), k_cache.stride(0), ROW=row, BLOCK=block
    )
