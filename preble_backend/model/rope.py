"""RoPE as each family's checkpoint sets it: which variant (``rope_type``) with which
parameters, and the inverse frequencies transformers computes for it.

Hugging Face has written RoPE settings two ways (``rope_theta`` + ``rope_scaling`` before
transformers 5, one ``rope_parameters`` dict after); both are accepted here so checkpoints
from either era load. Variants: ``default``, ``linear``, ``llama3`` and ``yarn`` (gpt-oss;
its cos and sin are also scaled by an attention factor, ``rope_attention_factor``); the
others (``dynamic``, ``longrope``, ...) are refused by name.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch is imported where RoPE is computed: the model card reads configs
    import torch  # in processes that never load it (the front)

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn")


def rope_inv_freq(rope: dict, head_dim: int, max_position_embeddings: int) -> torch.Tensor:
    """The inverse frequencies of ``rope``, computed exactly as Hugging Face does."""
    import torch

    base, dim, kind = rope["rope_theta"], head_dim, rope["rope_type"]
    inv = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    if kind == "linear":
        inv = inv / rope["factor"]
    elif kind == "llama3":
        inv = _llama3_inv_freq(inv, rope)
    elif kind == "yarn":
        inv = _yarn_inv_freq(rope, dim, max_position_embeddings)
    return inv


def rope_attention_factor(rope: dict) -> float:
    """What cos and sin are multiplied by: 1, except YaRN's ``attention_factor`` (by default
    ``0.1 ln(factor) + 1``, or its ``mscale`` / ``mscale_all_dim`` ratio)."""
    if rope["rope_type"] != "yarn":
        return 1.0
    if rope.get("attention_factor") is not None:
        return float(rope["attention_factor"])
    factor = rope["factor"]

    def scale(mscale: float = 1.0) -> float:
        return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0

    if rope.get("mscale") and rope.get("mscale_all_dim"):
        return float(scale(rope["mscale"]) / scale(rope["mscale_all_dim"]))
    return scale()


def _yarn_inv_freq(rope: dict, dim: int, max_position_embeddings: int) -> torch.Tensor:
    """YaRN: frequencies interpolated by ``factor`` below the correction range, kept above
    it, ramped linearly between (transformers' ``_compute_yarn_parameters``, op for op)."""
    import torch

    # transformers fills a missing original length with the model's own
    base, old_len = (
        rope["rope_theta"],
        rope.get("original_max_position_embeddings") or max_position_embeddings,
    )
    factor = rope.get("factor") or max_position_embeddings / old_len
    fast, slow = rope.get("beta_fast") or 32, rope.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(old_len / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(fast), correction_dim(slow)
    if rope.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # as transformers: no singular ramp
    pos_freqs = base ** (torch.arange(0, dim, 2).float() / dim)
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    extrapolation = 1 - ramp
    return 1.0 / (factor * pos_freqs) * (1 - extrapolation) + 1.0 / pos_freqs * extrapolation


def rope_parameters(cfg: dict) -> dict:
    """RoPE settings as transformers 5 reads them: ``rope_scaling``, where a config has it,
    replaces ``rope_parameters`` (model cards tell users to add it for longer contexts, to
    a config that already has ``rope_parameters``); ``rope_theta`` is then the dict's own,
    else the config's top-level one, else 10,000."""
    source = "rope_scaling" if cfg.get("rope_scaling") else "rope_parameters"
    params = dict(cfg.get(source) or {})
    params.setdefault("rope_theta", cfg.get("rope_theta", 10000.0))
    kind = params.get("rope_type") or params.get("type") or "default"
    if kind not in SUPPORTED_ROPE_TYPES:
        raise ValueError(f"{source} rope_type {kind!r} is not supported; expected one of "
                         f"{SUPPORTED_ROPE_TYPES}")  # fmt: skip
    params["rope_type"] = kind
    return params


def gemma3_ropes(cfg: dict, layer_types: list[str]) -> tuple[dict, ...]:
    """Gemma 3's RoPE per layer, as transformers 5 converts either era's config: the full
    layers take ``rope_theta`` (1e6 by default) and ``rope_scaling``, the sliding ones
    ``rope_local_base_freq`` (1e4); ``rope_parameters`` by layer kind where a config has it."""
    params = {kind: dict(v) for kind, v in (cfg.get("rope_parameters") or {}).items() if isinstance(v, dict)}
    full = {"rope_type": "default", **params.get("full_attention", {}), **(cfg.get("rope_scaling") or {})}
    full.setdefault("rope_theta", cfg.get("rope_theta", 1_000_000.0))
    local = {"rope_type": "default", **params.get("sliding_attention", {})}
    local.setdefault("rope_theta", cfg.get("rope_local_base_freq", 10_000.0))
    ropes = {}
    for kind, rope in (("full_attention", full), ("sliding_attention", local)):
        rope["rope_type"] = rope.get("rope_type") or rope.pop("type", "default")
        if rope["rope_type"] not in SUPPORTED_ROPE_TYPES:
            raise ValueError(f"{kind} rope_type {rope['rope_type']!r} is not supported; expected one of "
                             f"{SUPPORTED_ROPE_TYPES}")  # fmt: skip
        ropes[kind] = rope
    return tuple(ropes[t] for t in layer_types)


def _llama3_inv_freq(inv_freq: torch.Tensor, rope: dict) -> torch.Tensor:
    """Llama 3.1 frequency-dependent rescaling: long wavelengths stretched, short kept."""
    import torch

    factor = rope["factor"]
    low, high = rope["low_freq_factor"], rope["high_freq_factor"]
    old_len = rope["original_max_position_embeddings"]
    low_wavelen, high_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(is_medium, smoothed, scaled)
