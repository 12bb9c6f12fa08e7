"""The ``triton`` attention backend: the kernels of ``kernels/`` on a CUDA device (or in
Triton's interpreter on the CPU, for tests).

Per forward, layer 0 builds one plan (work items, sequence lengths, cascade groups) that
every later layer reuses. Requests sharing at least ``cascade_threshold(device)`` tokens
of radix-cache pages are attended as a cascade: their shared prefix once for the group.
"""

from __future__ import annotations

import torch

from kernels.cascade import cascade_attention_planned, decode_plan, plan_cascade
from kernels.kv_write import kv_write
from kernels.reference import attention_sinks_ref
from kernels.tuning import interpreting
from preble_backend.model.attention import AttentionBackend

# Below this the shared pass costs more than reading the prefix once per request: the
# default, where no crossover was measured (and in the interpreter, so tests reach cascade).
CASCADE_MIN_SHARED_TOKENS = 256
# Measured crossovers, by compute capability (docs/KERNELS.md, decode batches against plain
# split-KV decode). sm_90 (H100; the H200 is the same chip): cascade 0.64x plain at a 4k
# shared prefix, 0.78x at 8k, 3.40x at 32k; 16k is between the last loss and the first win
# (not measured at 16k itself, nor for groups carrying prefill chunks).
CASCADE_THRESHOLDS = {(9, 0): 16384}


def cascade_threshold(device: torch.device) -> int:
    """Shared tokens from which a group goes through cascade on ``device``."""
    if device.type != "cuda":
        return CASCADE_MIN_SHARED_TOKENS
    return CASCADE_THRESHOLDS.get(torch.cuda.get_device_capability(device), CASCADE_MIN_SHARED_TOKENS)


class TritonAttention(AttentionBackend):
    name = "triton"
    capturable = True

    def __init__(self, device: torch.device) -> None:
        if device.type != "cuda" and not interpreting():
            raise ValueError(
                "attention_backend 'triton' needs a CUDA device (on the CPU only Triton's interpreter "
                "runs it: start with TRITON_INTERPRET=1, for tests)"
            )
        self.cascade_forwards = 0  # forwards that attended a shared prefix once per group
        self.min_shared_tokens = cascade_threshold(device)

    def forward(self, layer, q, k, v, batch, pool, window=None, scale=None, sinks=None):
        k_cache, v_cache = pool.k_cache[layer], pool.v_cache[layer]
        kv_write(k_cache, v_cache, k, v, batch.slot_mapping)
        if batch.plan is None:
            batch.plan = plan_cascade(q, k_cache, batch.q_lens, batch.prefix_lens, batch.shared_prefixes)
            self.cascade_forwards += bool(batch.shared_prefixes)
        plan = batch.plan
        if window is not None and plan.shared_rows.numel():  # a sliding layer attends without groups
            if batch.sliding_plan is None:
                batch.sliding_plan = plan_cascade(q, k_cache, batch.q_lens, batch.prefix_lens, [])
            plan = batch.sliding_plan
        out, lse = cascade_attention_planned(q, k_cache, v_cache, batch.page_table, batch.page_size, plan,
                                             sm_scale=scale, window=window)  # fmt: skip
        return out if sinks is None else attention_sinks_ref(out, lse, sinks)  # merged by the kernel's LSE

    def decode_plan(self, kv_starts, seq_lens, max_seq_len):
        return decode_plan(kv_starts, seq_lens, max_seq_len)
