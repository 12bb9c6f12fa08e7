"""Turns a scheduled batch into one forward pass: flat token ids, positions, slot mapping,
page tables; returns the logits of the requests that sample this iteration."""

from __future__ import annotations

from pathlib import Path

import torch

from preble_backend.engine.local_scheduler import ScheduledBatch
from preble_backend.model.attention import AttentionBatch, shared_prefix_groups
from preble_backend.model.attention_backends import make_attention_backend
from preble_backend.model.kv_pool import KVPool
from preble_backend.model.llama import LlamaForCausalLM


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """``auto``: fp32 on CPU (bf16 matmuls there are slow and lossy), bf16 on CUDA."""
    table = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if name not in table:
        raise ValueError(f"dtype must be one of auto, {', '.join(table)}; got {name!r}")
    return table[name]


class ModelRunner:
    def __init__(self, model_path: str | Path, dtype: str, device: str, attention_backend: str):
        self.device = torch.device(device)
        self.dtype = resolve_dtype(dtype, self.device)
        self.model = LlamaForCausalLM.from_pretrained(model_path, self.dtype, self.device)
        self.cfg = self.model.cfg
        self.backend = make_attention_backend(attention_backend, self.device)

    def make_pool(self, num_pages: int, page_size: int) -> KVPool:
        cfg = self.cfg
        return KVPool(
            num_pages, page_size, cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, self.dtype, self.device
        )

    def kv_bytes_per_token(self) -> int:
        cfg = self.cfg
        return 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * self.dtype.itemsize

    def went_idle(self) -> None:
        """The engine ran out of work (an emulated device stops overlapping; this one has
        nothing to do)."""

    def stats(self) -> dict[str, float]:
        return {}

    def forward(self, batch: ScheduledBatch, pool: KVPool) -> tuple[torch.Tensor, list[int]]:
        """Logits for the requests whose whole sequence is computed after this pass, and
        their indices in ``batch``."""
        ids, positions, slots, logit_rows, sampling = [], [], [], [], []
        ps = pool.page_size
        offset = 0
        for i, (req, n) in enumerate(zip(batch.requests, batch.num_new_tokens)):
            start = req.num_computed
            ids.extend(req.tokens(start, start + n))
            pos = range(start, start + n)
            positions.extend(pos)
            slots.extend(req.page_table[p // ps] * ps + p % ps for p in pos)
            offset += n
            if start + n == req.num_tokens:
                logit_rows.append(offset - 1)
                sampling.append(i)
        dev = self.device
        reqs = batch.requests
        width = max(len(r.page_table) for r in reqs)
        table = torch.tensor(
            [r.page_table + [0] * (width - len(r.page_table)) for r in reqs], dtype=torch.int32
        )
        groups = []
        if self.backend.min_shared_tokens is not None and len(reqs) > 1:
            tree_pages = [r.page_table[: r.num_tree_pages] for r in reqs]
            groups = shared_prefix_groups(tree_pages, ps, self.backend.min_shared_tokens)
        attn = AttentionBatch(
            q_lens=list(batch.num_new_tokens),
            prefix_lens=[r.num_computed for r in reqs],
            slot_mapping=torch.tensor(slots, dtype=torch.long, device=dev),
            page_table=table.to(dev),
            page_size=ps,
            shared_prefixes=groups,
        )
        logits = self.model(
            torch.tensor(ids, dtype=torch.long, device=dev),
            torch.tensor(positions, dtype=torch.long, device=dev),
            attn,
            pool,
            self.backend,
            torch.tensor(logit_rows, dtype=torch.long, device=dev),
        )
        return logits, sampling
