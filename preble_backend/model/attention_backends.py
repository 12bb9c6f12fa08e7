"""Which attention backend an engine runs: the registry of ``attention.py``'s seam, apart
from it so that the backends, which implement the seam, and the registry, which imports
them only when one is asked for, do not import each other."""

from __future__ import annotations

import torch

from preble_backend.common.settings import ATTENTION_BACKENDS
from preble_backend.model.attention import AttentionBackend, TorchAttention


def make_attention_backend(name: str, device: torch.device) -> AttentionBackend:
    """``auto`` is the batched SDPA path on the CPU and the Triton kernels on CUDA; ``torch``
    is the kernels' reference, request by request."""
    if name == "auto":
        name = "triton" if device.type == "cuda" else "sdpa"
    if name == "torch":
        return TorchAttention()
    if name == "sdpa":
        from preble_backend.model.attention_sdpa import SdpaAttention

        return SdpaAttention()
    if name == "triton":
        from preble_backend.model.attention_triton import TritonAttention

        return TritonAttention(device)
    if name == "flashinfer":
        from preble_backend.model.attention_flashinfer import FlashInferAttention

        return FlashInferAttention(device)
    raise ValueError(
        f"attention_backend {name!r} is not available; accepted: {', '.join(ATTENTION_BACKENDS)}"
    )
