"""Decode without launch overhead: the model's decode step captured as CUDA graphs, one
per batch-size bucket, replayed with each batch copied into fixed buffers, as vLLM and
SGLang do.

At batch 1 an 8B model's decode step is hundreds of small kernels whose launches take
longer than their work; a replay launches them all at once. A step can be captured when
every tensor it reads lives at an address that never changes (token ids, positions, KV
slots, page table, sequence lengths: the buffers below) and its launch grids depend on the
bucket alone (the attention backend's ``decode_plan``: the split count chosen for the
longest context served, a shorter one leaving splits empty). A batch is padded to its
bucket: a padding row writes no KV (slot -1) and sees no context (length 0), and its
logits are never read. A model with sliding layers reads their pages through buffers of
their own (the window pool's slots and page table, ``kv_pool.py``), with the same lengths.

Without ``capture`` (the CPU, where there are no graphs) every step runs the same padded,
buffer-reading forward eagerly: what the tests check against the eager path.
"""

from __future__ import annotations

import torch

from preble_backend.model.attention import AttentionBackend, AttentionBatch
from preble_backend.model.kv_pool import KVPool
from preble_backend.model.llama import LlamaForCausalLM

SMALL_BUCKETS = (1, 2, 4)  # then every multiple of 8 up to the largest batch


def batch_buckets(max_batch: int) -> list[int]:
    """The batch sizes captured: 1, 2, 4, then multiples of 8, and ``max_batch`` itself."""
    sizes = [b for b in SMALL_BUCKETS if b < max_batch] + list(range(8, max_batch, 8))
    return sizes + [max_batch]


class DecodeGraphs:
    def __init__(self, model: LlamaForCausalLM, backend: AttentionBackend, pool: KVPool,
                 max_batch: int, max_context: int, capture: bool) -> None:  # fmt: skip
        self.model, self.backend, self.pool = model, backend, pool
        self.max_batch, self.max_context = max_batch, max_context
        self.max_pages = KVPool.pages_for(max_context, pool.page_size)
        dev = pool.k_cache.device
        self.ids = torch.zeros(max_batch, dtype=torch.long, device=dev)
        self.positions = torch.zeros(max_batch, dtype=torch.long, device=dev)
        self.slots = torch.full((max_batch,), -1, dtype=torch.long, device=dev)
        self.page_table = torch.zeros((max_batch, self.max_pages), dtype=torch.int32, device=dev)
        self.seq_lens = torch.zeros(max_batch, dtype=torch.int32, device=dev)
        self.kv_starts = torch.zeros(max_batch, dtype=torch.int32, device=dev)  # no cascade: all 0
        self.rows = torch.arange(max_batch, dtype=torch.long, device=dev)
        self.window_slots = self.window_table = None
        if pool.window is not None:
            self.window_slots = torch.full_like(self.slots, -1)
            self.window_table = torch.zeros_like(self.page_table)
        self.buckets = batch_buckets(max_batch)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.replays = 0  # steps served through the buffers (replayed, or run eagerly on them)
        if capture:
            self._capture()

    def accepts(self, attn: AttentionBatch) -> bool:
        """A batch of decodes alone (one new token each, no shared-prefix group to cascade)
        that fits the buffers."""
        n = len(attn.q_lens)
        return (
            0 < n <= self.max_batch
            and not attn.shared_prefixes
            and all(q == 1 for q in attn.q_lens)
            and attn.page_table.shape[1] <= self.max_pages
            and max(attn.seq_lens) <= self.max_context
        )

    def run(self, ids: torch.Tensor, positions: torch.Tensor, attn: AttentionBatch) -> torch.Tensor:
        """fp32 logits of every request of an accepted batch, [n, vocab]: the batch copied
        into the buffers, its bucket's graph replayed."""
        n = len(attn.q_lens)
        bucket = next(b for b in self.buckets if b >= n)
        self.ids[:n].copy_(ids)
        self.positions[:n].copy_(positions)
        self.slots[:n].copy_(attn.slot_mapping)
        self.slots[n:bucket].fill_(-1)
        # Columns past a row's own pages keep older ids: the kernels read no further than
        # the row's length.
        self.page_table[:n, : attn.page_table.shape[1]].copy_(attn.page_table)
        if self.window_table is not None:
            self.window_slots[:n].copy_(attn.window.slot_mapping)
            self.window_slots[n:bucket].fill_(-1)
            self.window_table[:n, : attn.page_table.shape[1]].copy_(attn.window.page_table)
        self.seq_lens[:n].copy_(torch.tensor(attn.seq_lens, dtype=torch.int32))
        self.seq_lens[n:bucket].zero_()
        self.replays += 1
        if bucket in self.graphs:
            graph, logits = self.graphs[bucket]
            graph.replay()
        else:
            logits = self._step(bucket)
        return logits[:n]

    def _step(self, bucket: int) -> torch.Tensor:
        """One decode step over the first ``bucket`` rows of the buffers. The batch's host
        lists are the bucket's shape only: the lengths live in the plan's buffers."""
        plan = self.backend.decode_plan(self.kv_starts[:bucket], self.seq_lens[:bucket], self.max_context)
        attn = AttentionBatch(
            q_lens=[1] * bucket,
            prefix_lens=[],  # unknown when captured: read from ``seq_lens`` at each replay
            slot_mapping=self.slots[:bucket],
            page_table=self.page_table[:bucket],
            page_size=self.pool.page_size,
            shared_prefixes=[],
            plan=plan,
        )
        if self.window_table is not None:  # the same lengths, in the window pool's pages
            window = (self.window_slots[:bucket], self.window_table[:bucket])
            attn.window = AttentionBatch([1] * bucket, [], *window, self.pool.page_size, [], plan=plan)
        rows = self.rows[:bucket]
        return self.model(self.ids[:bucket], self.positions[:bucket], attn, self.pool, self.backend, rows)

    def _capture(self) -> None:
        """Largest bucket first, all in one memory pool, so that smaller graphs reuse the
        largest's memory. Each is run once before its capture: Triton compiles at first
        launch, and a compile cannot be captured."""
        memory = torch.cuda.graph_pool_handle()
        for bucket in reversed(self.buckets):
            self._step(bucket)
            torch.cuda.synchronize(self.pool.k_cache.device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=memory):
                logits = self._step(bucket)
            self.graphs[bucket] = (graph, logits)
