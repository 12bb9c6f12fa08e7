"""Llama-family decoder (Llama 2/3, Mistral, Qwen2, Qwen3; Qwen3-MoE and Mixtral with the
mixture of ``moe.py``) over a flat, ragged token batch.

The batch has no padding: ``input_ids`` and ``positions`` are the concatenated new tokens
of every request, and attention is delegated to an ``AttentionBackend`` that knows where
each request's context lives in the paged KV pool. The numerics follow Hugging Face's
modeling code (RMSNorm in fp32, rotate-half RoPE) so greedy outputs match token for token.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file
from torch import nn

from preble_backend.model.activations import activation
from preble_backend.model.attention import AttentionBackend, AttentionBatch
from preble_backend.model.kv_pool import KVPool
from preble_backend.model.model_card import weight_files
from preble_backend.model.model_config import ModelConfig
from preble_backend.model.moe import SparseMoE, fuse_experts
from preble_backend.model.rope import rope_attention_factor
from preble_backend.model.safetensors_slices import DTYPES, read_header, read_slice
from preble_backend.model.tensor_parallel import TPGroup, shard_model, slice_of


class RMSNorm(nn.Module):
    """Llama's (``weight * normed.to(dtype)``), Gemma's (``plus_one``: ``normed * (1 +
    weight)`` in fp32, then the dtype) or gpt-oss's (``fp32``: ``weight * normed`` in fp32,
    then the dtype), as each family's transformers code rounds."""

    def __init__(self, dim: int, eps: float, plus_one: bool = False, fp32: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps, self.plus_one, self.fp32 = eps, plus_one, fp32

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.plus_one:
            return (x32 * (1.0 + self.weight.float())).to(dtype)
        if self.fp32:
            return (self.weight.float() * x32).to(dtype)
        return self.weight * x32.to(dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        super().__init__()
        self.layer = layer
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        h, bias = cfg.hidden_size, cfg.qkv_bias
        self.q_proj = nn.Linear(h, cfg.num_heads * cfg.head_dim, bias=bias)
        self.k_proj = nn.Linear(h, cfg.num_kv_heads * cfg.head_dim, bias=bias)
        self.v_proj = nn.Linear(h, cfg.num_kv_heads * cfg.head_dim, bias=bias)
        self.o_proj = nn.Linear(cfg.num_heads * cfg.head_dim, h, bias=cfg.o_bias)
        self.window, self.scale = cfg.window(layer), cfg.attn_scale
        self.sliding, self.kv_index = cfg.kv_group(layer)
        self.sinks = nn.Parameter(torch.empty(cfg.num_heads)) if cfg.attention_sinks else None
        self.qk_norm = cfg.qk_norm
        if cfg.qk_norm:  # Qwen3, Gemma 3: each head's q and k normalised before RoPE
            self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, cfg.norm_plus_one)
            self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, cfg.norm_plus_one)

    def forward(self, x, cos, sin, batch: AttentionBatch, pool: KVPool, backend: AttentionBackend):
        t = x.shape[0]
        q = self.q_proj(x).view(t, self.num_heads, self.head_dim)
        k = self.k_proj(x).view(t, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).view(t, self.num_kv_heads, self.head_dim)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        if pool.window is not None:  # the KV of full and sliding layers in pools of their own
            if self.sliding:
                pool, batch = pool.window, batch.window
            out = backend.forward(self.kv_index, q, k, v, batch, pool, self.window, self.scale, self.sinks)
        else:
            out = backend.forward(self.layer, q, k, v, batch, pool, self.window, self.scale, self.sinks)
        return self.o_proj(out.reshape(t, -1))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.act = activation(cfg.hidden_act)
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=cfg.mlp_bias)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=cfg.mlp_bias)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=cfg.mlp_bias)

    def forward(self, x):
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        super().__init__()
        self.self_attn = Attention(cfg, layer)
        self.mlp = SparseMoE(cfg) if cfg.moe and layer in cfg.moe.sparse_layers else MLP(cfg)
        norm = (cfg.hidden_size, cfg.rms_norm_eps, cfg.norm_plus_one, cfg.norm_weight_fp32)
        self.input_layernorm = RMSNorm(*norm)
        self.post_attention_layernorm = RMSNorm(*norm)
        self.sandwich = cfg.sandwich_norms
        if self.sandwich:  # Gemma: post_attention_layernorm norms the attention's output
            self.pre_feedforward_layernorm = RMSNorm(*norm)
            self.post_feedforward_layernorm = RMSNorm(*norm)

    def forward(self, x, cos, sin, batch, pool, backend):
        attended = self.self_attn(self.input_layernorm(x), cos, sin, batch, pool, backend)
        if not self.sandwich:
            x = x + attended
            return x + self.mlp(self.post_attention_layernorm(x))
        x = x + self.post_attention_layernorm(attended)
        return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))


class LlamaForCausalLM(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.norm_plus_one, cfg.norm_weight_fp32)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        # one RoPE per distinct setting (Gemma 3: local and global), each layer's by index
        ropes = [cfg.rope_of(i) for i in range(cfg.num_layers)]
        distinct = [r for i, r in enumerate(ropes) if r not in ropes[:i]]
        self.ropes, self.rope_index = distinct, [distinct.index(r) for r in ropes]
        self.rope_scales = [rope_attention_factor(r) for r in distinct]  # YaRN's; else 1
        self.register_buffer("inv_freq", self.rope_frequencies(), persistent=False)

    def rope_frequencies(self) -> torch.Tensor:
        """[R, D/2]: each distinct RoPE's inverse frequencies."""
        return torch.stack([self.cfg.inv_freq(r) for r in self.ropes])

    def rope(self, positions: torch.Tensor, dtype: torch.dtype) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(cos, sin) [T, 1, D] of each distinct RoPE."""
        freqs = positions[:, None, None].float() * self.inv_freq.float()[None]  # [T, R, D/2]
        emb = torch.cat((freqs, freqs), dim=-1)
        out = []
        for r, scale in enumerate(self.rope_scales):
            cos, sin = emb[:, r].cos(), emb[:, r].sin()
            if scale != 1.0:
                cos, sin = cos * scale, sin * scale
            out.append((cos.to(dtype)[:, None, :], sin.to(dtype)[:, None, :]))
        return out

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        batch: AttentionBatch,
        pool: KVPool,
        backend: AttentionBackend,
        logits_indices: torch.Tensor,
    ) -> torch.Tensor:
        """Run the new tokens; return fp32 logits only at ``logits_indices`` (sampling rows)."""
        x = self.embed_tokens(input_ids)
        if self.cfg.embed_scale is not None:  # Gemma: sqrt(hidden), rounded to the weights' dtype
            x = x * torch.tensor(self.cfg.embed_scale, dtype=x.dtype)
        ropes = self.rope(positions, x.dtype)
        for layer, r in zip(self.layers, self.rope_index):
            x = layer(x, *ropes[r], batch, pool, backend)
        logits = self.lm_head(self.norm(x[logits_indices]))
        if self.cfg.final_softcap:
            logits = torch.tanh(logits / self.cfg.final_softcap) * self.cfg.final_softcap
        return logits.float()

    @classmethod
    def from_pretrained(cls, model_path: str | Path, dtype: torch.dtype, device,
                        tp: TPGroup | None = None) -> LlamaForCausalLM:  # fmt: skip
        """The checkpoint on ``device``; with ``tp``, that rank's slice of it, each sliced
        tensor read from the safetensors as its slice alone (``slice_of``)."""
        cfg = ModelConfig.from_dir(model_path)
        with torch.device("meta"):
            model = cls(cfg)
        sliced = tp is not None and tp.size > 1
        if sliced:  # this rank's shapes, then only its slices read from the checkpoint
            shard_model(model, tp)
        state = _load_state_dict(Path(model_path), (lambda key: slice_of(key, cfg, tp)) if sliced else None)
        if cfg.moe:
            state = fuse_experts(state, cfg.moe, tp.rank if sliced else 0)
        if cfg.tie_word_embeddings:  # a checkpoint without it and untied lacks it: refused below
            state["lm_head.weight"] = state["embed_tokens.weight"]
        expected = set(model.state_dict())
        missing = expected - set(state)
        if missing:
            tie = " (tie_word_embeddings is false)" if "lm_head.weight" in missing else ""
            raise ValueError(f"checkpoint {model_path} lacks weights: {sorted(missing)[:5]}{tie}")
        unused = sorted(k for k in set(state) - expected if not k.endswith("rotary_emb.inv_freq"))
        if unused:  # a tensor the model would silently drop: its arithmetic would differ
            more = f" and {len(unused) - 5} more" if len(unused) > 5 else ""
            raise ValueError(
                f"checkpoint {model_path} has weights the model does not use: {unused[:5]}{more}"
            )
        model.load_state_dict({k: state[k].to(dtype) for k in expected}, strict=True, assign=True)
        model.inv_freq = model.rope_frequencies()  # built on the meta device above
        return model.to(device).eval()


def _load_state_dict(path: Path, slicer=None) -> dict[str, torch.Tensor]:
    """The checkpoint's tensors (``weight_files``), with Hugging Face's ``model.`` prefix
    stripped; ``slicer(key)``: the (dim, start, count) of a tensor to read, or a list of
    them to concatenate along that dim, None: all (a slice is read into memory of its own,
    ``safetensors_slices``)."""
    state: dict[str, torch.Tensor] = {}
    for name in weight_files(path):
        if slicer is None:
            state.update((k.removeprefix("model."), t) for k, t in load_file(str(path / name)).items())
            continue
        data_start, header = read_header(path / name)
        fd = os.open(path / name, os.O_RDONLY)
        try:
            with safe_open(str(path / name), framework="pt") as f:
                for key in f.keys():
                    short = key.removeprefix("model.")
                    parts = slicer(short)
                    if parts is None:
                        state[short] = f.get_tensor(key)
                        continue
                    parts = parts if isinstance(parts, list) else [parts]
                    if header[key]["dtype"] in DTYPES:
                        read = [read_slice(fd, data_start, header[key], *p) for p in parts]
                    else:
                        read = [_mapped_slice(f, key, *p) for p in parts]
                    state[short] = read[0] if len(read) == 1 else torch.cat(read, dim=parts[0][0])
        finally:
            os.close(fd)
    return state


def _mapped_slice(f, key: str, dim: int, start: int, count: int) -> torch.Tensor:
    return f.get_slice(key)[(slice(None),) * dim + (slice(start, start + count),)]
