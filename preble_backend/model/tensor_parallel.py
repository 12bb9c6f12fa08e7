"""Tensor parallelism over ``torch.distributed`` (NCCL on CUDA, gloo on CPU): one rank's
slice of a decoder, as Megatron-LM splits it and vLLM and SGLang serve it.

- Attention is split by heads: q, k and v are column-parallel (each rank computes its own
  heads), o is row-parallel (each rank multiplies its heads' part; one all-reduce sums
  them). KV heads are divided across ranks; where there are fewer KV heads than ranks
  (GQA 8 KV heads at TP 16, 2 at TP 4) each is replicated on the ranks whose query heads
  read it, so a rank's KV pool holds only the heads its queries use.
- The MLP: gate and up column-parallel, down row-parallel; one all-reduce.
- Embeddings and ``lm_head`` are replicated, not vocab-parallel: every rank then holds
  the whole hidden state and rank 0 the whole logits row it samples from, without an
  all-gather per step; what it costs is ``2 × vocab × hidden`` parameters per rank
  (2.1 GB at Llama-3-70B's 128k × 8k in bf16), small beside a 70B model's 35 GB per rank
  at TP 4.
- A row-parallel bias is added once, after the all-reduce.

Two all-reduces per layer, the minimum for this split. The sum is taken in the weights'
dtype, in an order that differs from one matmul's, so logits differ from TP 1 in the last
bits; greedy tokens are equal unless two logits tie to that precision.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from preble_backend.model.model_config import ModelConfig


@dataclass(frozen=True)
class TPGroup:
    """This process's place among the ranks of one engine; ``group`` sums a tensor over
    them (``engine/runners/tp_ranks.Group``)."""

    rank: int
    size: int
    group: object = None

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        return self.group.all_reduce(x)


@dataclass(frozen=True)
class HeadSplit:
    """Which query and KV heads one rank holds."""

    q_start: int
    q_count: int
    kv_start: int
    kv_count: int


def head_split(cfg: ModelConfig, size: int, rank: int) -> HeadSplit:
    """Rank ``rank``'s heads; refused (naming why) where the heads do not divide."""
    heads, kv = cfg.num_heads, cfg.num_kv_heads
    if cfg.moe and cfg.moe.intermediate_size % size:
        raise ValueError(f"tensor_parallel_size={size} is invalid: the experts' {cfg.moe.intermediate_size} "
                         "intermediate features do not divide among the ranks")  # fmt: skip
    if heads % size:
        raise ValueError(f"tensor_parallel_size={size} is invalid: the model's {heads} attention heads "
                         "do not divide among the ranks")  # fmt: skip
    if kv % size and size % kv:
        raise ValueError(f"tensor_parallel_size={size} is invalid: the model's {kv} KV heads neither divide "
                         "among the ranks nor replicate evenly over them")  # fmt: skip
    dense = not cfg.moe or len(cfg.moe.sparse_layers) < cfg.num_layers
    if dense and cfg.intermediate_size % size:
        raise ValueError(f"tensor_parallel_size={size} is invalid: the MLP's {cfg.intermediate_size} "
                         "intermediate features do not divide among the ranks")  # fmt: skip
    per_rank, group = heads // size, heads // kv  # query heads per rank, and per KV head
    first = rank * per_rank
    last_kv = (first + per_rank - 1) // group
    return HeadSplit(first, per_rank, first // group, last_kv - first // group + 1)


class RowParallelLinear(nn.Module):
    """``linear`` restricted to this rank's input features; the partial products summed
    across ranks, then the bias added once."""

    def __init__(self, linear: nn.Linear, start: int, count: int, tp: TPGroup) -> None:
        super().__init__()
        self.weight = nn.Parameter(linear.weight[:, start : start + count].contiguous(), requires_grad=False)
        self.bias = linear.bias
        self.tp = tp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.tp.all_reduce(x @ self.weight.t())
        return out if self.bias is None else out + self.bias


def _rows(linear: nn.Linear, start: int, count: int) -> nn.Linear:
    """``linear`` keeping output features ``start .. start + count`` (column-parallel)."""
    part = nn.Linear(linear.in_features, count, bias=linear.bias is not None,
                     device=linear.weight.device, dtype=linear.weight.dtype)  # fmt: skip
    with torch.no_grad():
        part.weight.copy_(linear.weight[start : start + count])
        if linear.bias is not None:
            part.bias.copy_(linear.bias[start : start + count])
    return part.requires_grad_(False)


def slice_of(key: str, cfg: ModelConfig, tp: TPGroup) -> tuple[int, int, int] | None:
    """Which part of checkpoint tensor ``key`` rank ``tp.rank`` keeps, as (dim, start,
    count); None: all of it (norms, embeddings, ``lm_head``, row-parallel biases)."""
    split, hd = head_split(cfg, tp.size, tp.rank), cfg.head_dim
    inter = cfg.intermediate_size // tp.size
    name = key.rsplit(".", 2)
    if len(name) < 3 or not key.startswith("layers."):
        return None
    module, kind = name[1], name[2]
    if ".experts." in key or ".block_sparse_moe." in key:
        return _expert_slice(key, module, cfg, tp)
    if module == "q_proj":
        return 0, split.q_start * hd, split.q_count * hd
    if module in ("k_proj", "v_proj"):
        return 0, split.kv_start * hd, split.kv_count * hd
    if module in ("gate_proj", "up_proj"):
        return 0, tp.rank * inter, inter
    if module == "self_attn" and kind == "sinks":  # gpt-oss: one per query head
        return 0, split.q_start, split.q_count
    if module == "o_proj" and kind == "weight":
        return 1, split.q_start * hd, split.q_count * hd
    if module == "down_proj" and kind == "weight":
        return 1, tp.rank * inter, inter
    return None


def _expert_slice(key: str, module: str, cfg: ModelConfig, tp: TPGroup):
    """An expert's intermediate features are split as a dense MLP's: per-expert tensors
    (``gate_proj``/``w1``, ``up_proj``/``w3`` by rows, ``down_proj``/``w2`` by columns) and
    the fused ones (``gate_up_proj`` [E, 2I, H]: this rank's gate rows and its up rows;
    ``down_proj`` [E, H, I]: its columns). The router is whole on every rank."""
    size = cfg.moe.intermediate_size
    count = size // tp.size
    start = tp.rank * count
    if cfg.moe.interleaved:  # gpt-oss: [E, H, 2I] with a feature's gate and up side by side
        if key.endswith(("experts.gate_up_proj", "experts.gate_up_proj_bias")):
            return (1 if key.endswith("bias") else 2), 2 * start, 2 * count
        return (1, start, count) if key.endswith("experts.down_proj") else None
    if key.endswith("experts.gate_up_proj"):
        return [(1, start, count), (1, size + start, count)]
    if key.endswith("experts.down_proj"):
        return 2, start, count
    if module in ("gate_proj", "up_proj", "w1", "w3"):
        return 0, start, count
    if module in ("down_proj", "w2"):
        return 1, start, count
    return None


def shard_model(model: nn.Module, tp: TPGroup) -> HeadSplit:
    """Cut a loaded ``LlamaForCausalLM`` down to rank ``tp.rank``'s slice, in place."""
    cfg: ModelConfig = model.cfg
    split, hd = head_split(cfg, tp.size, tp.rank), cfg.head_dim
    inter = cfg.intermediate_size // tp.size
    for layer in model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        attn.q_proj = _rows(attn.q_proj, split.q_start * hd, split.q_count * hd)
        attn.k_proj = _rows(attn.k_proj, split.kv_start * hd, split.kv_count * hd)
        attn.v_proj = _rows(attn.v_proj, split.kv_start * hd, split.kv_count * hd)
        attn.o_proj = RowParallelLinear(attn.o_proj, split.q_start * hd, split.q_count * hd, tp)
        attn.num_heads, attn.num_kv_heads = split.q_count, split.kv_count
        if attn.sinks is not None:
            attn.sinks = nn.Parameter(
                attn.sinks[split.q_start : split.q_start + split.q_count], requires_grad=False
            )
        if hasattr(mlp, "experts"):  # a mixture: its experts' slices, one all-reduce after them
            mlp.shard(tp)
            continue
        mlp.gate_proj = _rows(mlp.gate_proj, tp.rank * inter, inter)
        mlp.up_proj = _rows(mlp.up_proj, tp.rank * inter, inter)
        mlp.down_proj = RowParallelLinear(mlp.down_proj, tp.rank * inter, inter, tp)
    return split
