"""Triton-language kernels: attention for a paged KV cache with shared prefixes and chunked
prefill, and the fused mixture-of-experts MLP.

One kernel family per file, each with its torch reference in ``reference.py``:
``extend_attention`` (chunks and decodes in one launch), ``decode_attention`` (split-KV),
``merge_state``/``merge_states`` (LSE merges), ``cascade_attention`` (shared prefixes read
once per group), ``kv_write`` (scatter into pages); and ``fused_moe`` (mixture-of-experts
MLPs as grouped GEMMs). Block sizes live in ``tuning.py``.
"""

from kernels.cascade import cascade_attention
from kernels.decode_attention import decode_attention
from kernels.extend_attention import extend_attention
from kernels.fused_moe import fused_moe
from kernels.kv_write import kv_write
from kernels.merge_state import merge_state, merge_states

__all__ = [
    "cascade_attention",
    "decode_attention",
    "extend_attention",
    "fused_moe",
    "kv_write",
    "merge_state",
    "merge_states",
]
