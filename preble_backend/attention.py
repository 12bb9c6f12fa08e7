"""The attention backend seam: one ragged batch of prefill chunks and decodes over paged KV.

A request in the batch contributes ``q_len`` new tokens that follow ``prefix_len`` tokens
already in the KV pool; its new tokens attend to that prefix (no mask) and to themselves
(causal). A decode is simply a chunk of length one. The torch backend below is the
reference and the CPU path; the Triton-language kernels (``kernels/``) plug in here.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from preble_backend.kv_pool import KVPool


@dataclass
class AttentionBatch:
    q_lens: list[int]
    prefix_lens: list[int]
    slot_mapping: torch.Tensor  # [num_tokens] flat KV slot of each new token
    context_slots: list[torch.Tensor]  # per request: flat KV slots of its whole context

    @property
    def seq_lens(self) -> list[int]:
        return [p + q for p, q in zip(self.prefix_lens, self.q_lens)]


class AttentionBackend(ABC):
    name: str

    @abstractmethod
    def forward(
        self,
        layer: int,
        q: torch.Tensor,  # [T, H, D]
        k: torch.Tensor,  # [T, Hkv, D]
        v: torch.Tensor,
        batch: AttentionBatch,
        pool: KVPool,
    ) -> torch.Tensor:  # [T, H, D]
        """Write the new K/V into their pages, then attend."""


class TorchAttention(AttentionBackend):
    """Gather each request's pages and run SDPA with a prefix-offset causal mask."""

    name = "torch"

    def forward(self, layer, q, k, v, batch, pool):
        k_cache, v_cache = pool.k_cache[layer], pool.v_cache[layer]
        k_cache[batch.slot_mapping] = k
        v_cache[batch.slot_mapping] = v
        out = torch.empty_like(q)
        group = q.shape[1] // k.shape[1]
        start = 0
        for q_len, prefix, slots in zip(batch.q_lens, batch.prefix_lens, batch.context_slots):
            seq_len = prefix + q_len
            keys = k_cache[slots].transpose(0, 1).repeat_interleave(group, dim=0)
            values = v_cache[slots].transpose(0, 1).repeat_interleave(group, dim=0)
            queries = q[start : start + q_len].transpose(0, 1)
            q_pos = torch.arange(prefix, seq_len, device=q.device)
            mask = torch.arange(seq_len, device=q.device)[None, :] <= q_pos[:, None]
            attn = F.scaled_dot_product_attention(queries, keys, values, attn_mask=mask)
            out[start : start + q_len] = attn.transpose(0, 1)
            start += q_len
        return out


def make_attention_backend(name: str) -> AttentionBackend:
    if name == "torch":
        return TorchAttention()
    raise ValueError(
        f"attention_backend {name!r} is not available; accepted: 'torch' "
        "('triton' and 'flashinfer' arrive with the kernels)"
    )
