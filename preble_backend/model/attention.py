"""The attention backend seam: one ragged batch of prefill chunks and decodes over paged KV.

A request in the batch contributes ``q_len`` new tokens that follow ``prefix_len`` tokens
already in the KV pool; its new tokens attend to that prefix (no mask) and to themselves
(causal). A decode is simply a chunk of length one. Backends: ``torch`` (the kernels'
torch reference, the CPU default), ``triton`` (``kernels/``, with cascade attention over
prefixes the radix cache shares) and ``flashinfer`` (when installed, GPU only).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any

import torch

from kernels.reference import attention_sinks_ref, extend_attention_ref, kv_write_ref
from preble_backend.common.prefix import longest_match
from preble_backend.model.kv_pool import KVPool


@dataclass
class AttentionBatch:
    q_lens: list[int]
    prefix_lens: list[int]
    slot_mapping: torch.Tensor  # [num_tokens] flat KV slot of each new token
    page_table: torch.Tensor  # [B, max_pages] int32: each request's pages, padded with 0
    page_size: int
    # Requests that hold the same radix-cache pages: (request indices, shared tokens).
    shared_prefixes: list[tuple[list[int], int]]
    plan: Any = None  # the backend's per-forward plan, built by layer 0 and reused
    sliding_plan: Any = None  # the same for sliding-window layers, where it must differ
    window: AttentionBatch | None = None  # the same batch in the window pool's pages (kv_pool.py)

    @property
    def seq_lens(self) -> list[int]:
        return [p + q for p, q in zip(self.prefix_lens, self.q_lens)]


class AttentionBackend(ABC):
    name: str
    # Fill ``shared_prefixes`` with groups sharing at least this many tokens (None: don't
    # group; it costs host time that only a cascade-capable backend recovers).
    min_shared_tokens: int | None = None
    capturable = False  # its decode steps can be captured in CUDA graphs (``decode_plan``)

    @abstractmethod
    def forward(
        self,
        layer: int,
        q: torch.Tensor,  # [T, H, D]
        k: torch.Tensor,  # [T, Hkv, D]
        v: torch.Tensor,
        batch: AttentionBatch,
        pool: KVPool,
        window: int | None = None,
        scale: float | None = None,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:  # [T, H, D]
        """Write the new K/V into their pages, then attend; with a ``window`` (a sliding
        layer), each query sees only the ``window`` keys up to itself. ``scale``: the
        scores' (default ``head_dim ** -0.5``; Gemma's ``query_pre_attn_scalar ** -0.5``).
        ``sinks`` [H]: gpt-oss's logit per head that joins the softmax with no value."""

    def decode_plan(self, kv_starts: torch.Tensor, seq_lens: torch.Tensor, max_seq_len: int) -> Any:
        """The plan of a decode batch that a CUDA graph replays (``decode_graphs.py``): its
        lengths in fixed device buffers, read afresh at each replay. Only a backend with
        ``capturable`` has one; the others plan from host lists on every forward."""
        raise NotImplementedError(f"attention_backend {self.name!r} cannot be captured in a CUDA graph")


class TorchAttention(AttentionBackend):
    """The kernels' torch reference (its SDPA path: no LSE needed), request by request."""

    name = "torch"

    def forward(self, layer, q, k, v, batch, pool, window=None, scale=None, sinks=None):
        k_cache, v_cache = pool.k_cache[layer], pool.v_cache[layer]
        kv_write_ref(k_cache, v_cache, k, v, batch.slot_mapping)
        out, lse = extend_attention_ref(
            q,
            k_cache,
            v_cache,
            batch.page_table,
            batch.q_lens,
            batch.prefix_lens,
            batch.page_size,
            sm_scale=scale,
            with_lse=sinks is not None,
            window=window,
        )
        return out if sinks is None else attention_sinks_ref(out, lse, sinks)


def shared_prefix_groups(
    tree_pages: list[list[int]], page_size: int, min_shared_tokens: int
) -> list[tuple[list[int], int]]:
    """Group requests whose cached pages begin with the same page: the radix cache hands
    every request matching a prefix the very same pages, so equal page ids are a shared
    prefix. A group's shared length is its members' longest common run of pages."""
    by_first: dict[int, list[int]] = {}
    for b, pages in enumerate(tree_pages):
        if len(pages) * page_size >= min_shared_tokens:
            by_first.setdefault(pages[0], []).append(b)
    groups = []
    for members in by_first.values():
        if len(members) < 2:
            continue
        first = tree_pages[members[0]]
        common = min(len(tree_pages[b]) for b in members)
        for b in members[1:]:
            other = tree_pages[b]
            common = longest_match(common, lambda n, a=other, b=first: a[:n] == b[:n])
        if common * page_size >= min_shared_tokens:
            groups.append((members, common * page_size))
    return groups
