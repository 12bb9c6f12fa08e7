"""The ``flashinfer`` attention backend (GPU, optional): FlashInfer's paged wrappers over
our pool (``kernels/flashinfer_paged.py``); the plan (page CSR, last-page lengths) is built
once per forward, by layer 0."""

from __future__ import annotations

import torch

from kernels.flashinfer_paged import FlashInferPaged
from preble_backend.model.attention import AttentionBackend


class FlashInferAttention(AttentionBackend):
    name = "flashinfer"

    def __init__(self, device: torch.device) -> None:
        self.paged = FlashInferPaged(device)

    def forward(self, layer, q, k, v, batch, pool, window=None, scale=None, sinks=None):
        if window is not None or scale is not None or sinks is not None:  # the engine refuses such a model
            raise ValueError(
                "attention_backend 'flashinfer' runs neither sliding windows, a scale of its own nor sinks"
            )
        k_cache, v_cache = pool.k_cache[layer], pool.v_cache[layer]
        k_cache[batch.slot_mapping] = k
        v_cache[batch.slot_mapping] = v
        if batch.plan is None:
            batch.plan = self.paged.plan(
                q, k, batch.page_table, batch.q_lens, batch.seq_lens, batch.page_size
            )
        shape = (-1, batch.page_size, k.shape[1], k.shape[2])  # NHD pages, a view of the pool
        return batch.plan.run(q.contiguous(), (k_cache.view(shape), v_cache.view(shape)))
