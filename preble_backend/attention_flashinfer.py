"""The ``flashinfer`` attention backend (GPU, optional): FlashInfer's paged prefill and
decode wrappers over our pool, viewed as FlashInfer's NHD page layout without a copy.

Used as the comparison point for our kernels and as an alternative engine backend; the
plan (page CSR, last-page lengths) is built once per forward, by layer 0.
"""

from __future__ import annotations

import torch

from preble_backend.attention import AttentionBackend

WORKSPACE_BYTES = 128 * 1024 * 1024


class FlashInferAttention(AttentionBackend):
    name = "flashinfer"

    def __init__(self, device: torch.device) -> None:
        if device.type != "cuda":
            raise ValueError("attention_backend 'flashinfer' needs a CUDA device")
        try:
            import flashinfer
        except ImportError as err:
            raise ValueError(
                "attention_backend 'flashinfer' needs the flashinfer-python package (pip install '.[gpu]')"
            ) from err
        workspace = torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device=device)
        self._prefill = flashinfer.BatchPrefillWithPagedKVCacheWrapper(workspace, "NHD")
        self._decode = flashinfer.BatchDecodeWithPagedKVCacheWrapper(workspace, "NHD")

    def _plan(self, q, k, batch):
        ps = batch.page_size
        seq_lens = batch.seq_lens
        num_pages = [-(-n // ps) for n in seq_lens]
        indices = torch.cat([batch.page_table[b, :n] for b, n in enumerate(num_pages)])
        indptr = torch.tensor([0, *torch.tensor(num_pages).cumsum(0).tolist()], dtype=torch.int32)
        last = torch.tensor([n - (p - 1) * ps for n, p in zip(seq_lens, num_pages)], dtype=torch.int32)
        dev = q.device
        common = dict(q_data_type=q.dtype, kv_data_type=k.dtype)
        heads = (q.shape[1], k.shape[1], q.shape[2], ps)
        if all(n == 1 for n in batch.q_lens):
            self._decode.plan(indptr.to(dev), indices.to(dev), last.to(dev), *heads, **common)
            return self._decode
        qo_indptr = torch.tensor([0, *torch.tensor(batch.q_lens).cumsum(0).tolist()], dtype=torch.int32)
        self._prefill.plan(
            qo_indptr.to(dev), indptr.to(dev), indices.to(dev), last.to(dev), *heads, causal=True, **common
        )
        return self._prefill

    def forward(self, layer, q, k, v, batch, pool):
        k_cache, v_cache = pool.k_cache[layer], pool.v_cache[layer]
        k_cache[batch.slot_mapping] = k
        v_cache[batch.slot_mapping] = v
        if batch.plan is None:
            batch.plan = self._plan(q, k, batch)
        shape = (-1, batch.page_size, k.shape[1], k.shape[2])  # NHD pages, a view of the pool
        return batch.plan.run(q.contiguous(), (k_cache.view(shape), v_cache.view(shape)))
