"""FlashInfer's paged prefill and decode wrappers, planned from our page table: the
comparison point for our kernels (``benchmark.py``) and what the engine's ``flashinfer``
attention backend runs. Our pool is viewed as FlashInfer's NHD page layout without a copy.
"""

from __future__ import annotations

import torch

WORKSPACE_BYTES = 128 * 1024 * 1024


class FlashInferPaged:
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
        the wrapper to ``run``."""
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


def _offsets(lengths: list[int], device) -> torch.Tensor:
    """CSR offsets: [0, l0, l0 + l1, ...] as int32."""
    out = [0]
    for n in lengths:
        out.append(out[-1] + int(n))
    return torch.tensor(out, dtype=torch.int32, device=device)
