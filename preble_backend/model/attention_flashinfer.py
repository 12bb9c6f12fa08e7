"""The ``flashinfer`` attention backend (GPU, optional): FlashInfer's paged prefill and
decode wrappers over our pool, viewed as FlashInfer's NHD page layout without a copy.

Used as the comparison point for our kernels and as an alternative engine backend; the
plan (page CSR, last-page lengths) is built once per forward, by layer 0.
"""

from __future__ import annotations

import torch

from preble_backend.model.attention import AttentionBackend

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

    def plan(self, q, k, page_table, q_lens, seq_lens, page_size):
        """Plan one batch (page CSR and last-page lengths from our page table); returns
        the wrapper to ``run``. The benchmark calls this too, on the same tables."""
        num_pages = [-(-n // page_size) for n in seq_lens]
        dev = q.device
        indices = torch.cat([page_table[b, :n] for b, n in enumerate(num_pages)])
        indptr = _offsets(num_pages, dev)
        last = torch.tensor(
            [n - (p - 1) * page_size for n, p in zip(seq_lens, num_pages)], dtype=torch.int32, device=dev
        )
        common = dict(q_data_type=q.dtype, kv_data_type=k.dtype)
        heads = (q.shape[1], k.shape[1], q.shape[2], page_size)
        if all(n == 1 for n in q_lens):
            self._decode.plan(indptr, indices, last, *heads, **common)
            return self._decode
        self._prefill.plan(_offsets(q_lens, dev), indptr, indices, last, *heads, causal=True, **common)
        return self._prefill

    def forward(self, layer, q, k, v, batch, pool):
        k_cache, v_cache = pool.k_cache[layer], pool.v_cache[layer]
        k_cache[batch.slot_mapping] = k
        v_cache[batch.slot_mapping] = v
        if batch.plan is None:
            batch.plan = self.plan(q, k, batch.page_table, batch.q_lens, batch.seq_lens, batch.page_size)
        shape = (-1, batch.page_size, k.shape[1], k.shape[2])  # NHD pages, a view of the pool
        return batch.plan.run(q.contiguous(), (k_cache.view(shape), v_cache.view(shape)))


def _offsets(lengths: list[int], device) -> torch.Tensor:
    """CSR offsets: [0, l0, l0 + l1, ...] as int32."""
    out = [0]
    for n in lengths:
        out.append(out[-1] + int(n))
    return torch.tensor(out, dtype=torch.int32, device=device)
