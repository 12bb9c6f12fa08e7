"""The mixture-of-experts MLP (Qwen3-MoE, Mixtral, gpt-oss): a router picks each token's
``top_k`` experts, and their outputs are summed, weighted by the router.

Weights are kept in transformers 5's fused layout: ``gate.weight`` [E, H],
``experts.gate_up_proj`` [E, 2I, H] (each expert's gate rows, then its up rows) and
``experts.down_proj`` [E, H, I]. Checkpoints written before it keep a module per expert
(Qwen3-MoE's ``mlp.experts.{e}.gate_proj``, Mixtral's ``block_sparse_moe.experts.{e}.w1``
for gate, ``w3`` for up, ``w2`` for down): ``fuse_experts`` stacks them at load, as
transformers' own conversion does. gpt-oss's checkpoints hold ``router`` (a linear layer
with a bias), ``experts.gate_up_proj`` [E, H, 2I] with gate and up columns interleaved,
``experts.down_proj`` [E, I, H] and a bias for each: ``fuse_experts`` turns them into the
same layout (gate rows, then up rows; the biases alike).

On the CPU the experts run as transformers' own default does (one grouped product per
projection over the pairs sorted by expert, then each token's choices summed), so the sums
agree with its forward; on a GPU, ``kernels/fused_moe.py`` runs them in one Triton grouped
GEMM per projection.
"""

from __future__ import annotations

import re

import torch
import torch.nn.functional as F
from torch import nn

from kernels.fused_moe import GROUPED_MM, fused_moe, grouped_moe_torch
from preble_backend.model.activations import clamped_swiglu, gated
from preble_backend.model.model_config import ModelConfig, MoESpec

# A per-expert tensor of an older checkpoint: (layer prefix, expert, projection).
_PER_EXPERT = re.compile(
    r"^(layers\.\d+)\.(?:mlp|block_sparse_moe)\.experts\.(\d+)\.(gate_proj|up_proj|down_proj|w1|w3|w2)\.weight$"
)
_ROLES = ("gate", "up", "down")
_ROLE = {"gate_proj": "gate", "w1": "gate", "up_proj": "up", "w3": "up", "down_proj": "down", "w2": "down"}


class Router(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.spec = cfg.moe
        self.weight = nn.Parameter(torch.empty(self.spec.num_experts, cfg.hidden_size))
        self.bias = nn.Parameter(torch.empty(self.spec.num_experts)) if self.spec.bias else None

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Each token's expert weights [T, k] and experts [T, k]."""
        logits = F.linear(x, self.weight, self.bias)
        if self.spec.router == "topk_softmax":  # gpt-oss: the top k logits, softmax over them
            top, experts = torch.topk(logits, self.spec.top_k, dim=-1)
            return torch.softmax(top, dim=1, dtype=top.dtype), experts
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
        weights, experts = torch.topk(probs, self.spec.top_k, dim=-1)
        if self.spec.renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return (weights.to(logits.dtype) if self.spec.cast_weights else weights), experts


class Experts(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        spec = cfg.moe
        limit = spec.swiglu_limit
        self.glu = gated(cfg.hidden_act) if limit is None else clamped_swiglu(limit, spec.swiglu_alpha)
        e, i, h = spec.num_experts, spec.intermediate_size, cfg.hidden_size
        # gpt-oss: held input-major, as its checkpoints are ([E, H, 2I], [E, I, H]), so that
        # the CPU's grouped product reads them as transformers does (a transposed view of
        # them runs its batch-1 products ~1.5x slower); ``weights`` gives both orientations
        # the same shape
        self.input_major = spec.interleaved
        self.gate_up_proj = nn.Parameter(torch.empty((e, h, 2 * i) if self.input_major else (e, 2 * i, h)))
        self.down_proj = nn.Parameter(torch.empty((e, i, h) if self.input_major else (e, h, i)))
        self.gate_up_proj_bias = nn.Parameter(torch.empty(e, 2 * i)) if spec.bias else None
        self.down_proj_bias = nn.Parameter(torch.empty(e, h)) if spec.bias else None

    def weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``gate_up`` [E, 2I, H] (gate rows, then up) and ``down`` [E, H, I], as views."""
        if self.input_major:
            return self.gate_up_proj.transpose(1, 2), self.down_proj.transpose(1, 2)
        return self.gate_up_proj, self.down_proj

    def hold(self, gate_up: torch.Tensor, down: torch.Tensor) -> None:
        """Keep ``weights()``-shaped tensors in this module's orientation."""
        if self.input_major:
            gate_up, down = gate_up.transpose(1, 2).contiguous(), down.transpose(1, 2).contiguous()
        self.gate_up_proj = nn.Parameter(gate_up, requires_grad=False)
        self.down_proj = nn.Parameter(down, requires_grad=False)

    def forward(self, x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        args = (x, *self.weights(), weights, experts, self.glu, self.gate_up_proj_bias, self.down_proj_bias)
        if x.is_cuda:  # one grouped GEMM per projection over every expert's tokens
            return fused_moe(*args)
        if GROUPED_MM is None:
            return self._one_expert_at_a_time(x, weights, experts)
        return grouped_moe_torch(*args)

    def _one_expert_at_a_time(self, x, weights, experts) -> torch.Tensor:
        """transformers' ``eager`` experts, for a torch without a grouped product on the CPU."""
        out = torch.zeros_like(x)
        biased = self.gate_up_proj_bias is not None
        gate_up, down = self.weights()
        for e in torch.unique(experts).tolist():  # sorted: expert order
            k_pos, tokens = torch.where((experts == e).T)  # choice-major, as transformers gathers them
            h = F.linear(x[tokens], gate_up[e], self.gate_up_proj_bias[e] if biased else None)
            y = F.linear(self.glu(*h.chunk(2, dim=-1)), down[e], self.down_proj_bias[e] if biased else None)
            out.index_add_(0, tokens, (y * weights[tokens, k_pos, None]).to(out.dtype))
        return out


class SparseMoE(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.gate = Router(cfg)
        self.experts = Experts(cfg)
        self.tp = None

    def shard(self, tp) -> None:
        """Keep rank ``tp.rank``'s slice of every expert's intermediate features (gate and
        up rows, down columns); each rank routes every token alike (the router is whole),
        so the partial outputs sum to the whole in one all-reduce."""
        experts = self.experts
        gate_up, down = experts.weights()
        size = down.shape[2]
        count = size // tp.size
        mine = slice(tp.rank * count, (tp.rank + 1) * count)
        gate, up = gate_up[:, :size], gate_up[:, size:]
        experts.hold(torch.cat([gate[:, mine], up[:, mine]], 1), down[:, :, mine])
        if experts.gate_up_proj_bias is not None:  # (the down bias: fuse_experts keeps it on rank 0 only)
            bias = experts.gate_up_proj_bias
            experts.gate_up_proj_bias = nn.Parameter(torch.cat([bias[:, mine], bias[:, size:][:, mine]], 1),
                                                     requires_grad=False)  # fmt: skip
        self.tp = tp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, experts = self.gate(x)
        out = self.experts(x, weights, experts)
        return out if self.tp is None else self.tp.all_reduce(out)


def fuse_experts(state: dict[str, torch.Tensor], spec: MoESpec, rank: int = 0) -> dict[str, torch.Tensor]:
    """``state`` with every per-expert tensor stacked into the fused layout (and Mixtral's
    ``block_sparse_moe`` named ``mlp``), gpt-oss's experts de-interleaved into it; a layer
    missing an expert's tensor is refused. ``rank``: a tensor-parallel rank other than 0
    drops the experts' down bias (each rank's partial outputs are summed: it is added once)."""
    per_layer: dict[str, dict[tuple[str, int], torch.Tensor]] = {}
    fused: dict[str, torch.Tensor] = {}
    for key, tensor in state.items():
        if m := _PER_EXPERT.match(key):
            per_layer.setdefault(m[1], {})[(_ROLE[m[3]], int(m[2]))] = tensor
        elif spec.interleaved and ".mlp." in key:
            fused.update(_gpt_oss_tensor(key, tensor, rank))
        else:
            fused[key.replace(".block_sparse_moe.", ".mlp.")] = tensor
    num_experts = spec.num_experts
    for layer, parts in per_layer.items():
        missing = [f"{role} of expert {e}" for role in _ROLES for e in range(num_experts)
                   if (role, e) not in parts]  # fmt: skip
        if missing:
            raise ValueError(f"checkpoint lacks {layer}'s {', '.join(missing[:4])}")
        gate, up, down = (torch.stack([parts[r, e] for e in range(num_experts)]) for r in _ROLES)
        fused[f"{layer}.mlp.experts.gate_up_proj"] = torch.cat([gate, up], dim=1)
        fused[f"{layer}.mlp.experts.down_proj"] = down
    return fused


def _gpt_oss_tensor(key: str, tensor: torch.Tensor, rank: int) -> dict[str, torch.Tensor]:
    """One of gpt-oss's MLP tensors in this module's layout: ``router`` named ``gate``; the
    gate and up columns of ``gate_up_proj`` [E, H, 2I] (and its bias) de-interleaved into
    all the gate columns, then the up ones (``Experts`` holds them input-major, as they
    come); the down bias zero off rank 0."""
    if ".mlp.router." in key:
        return {key.replace(".mlp.router.", ".mlp.gate."): tensor}
    if key.endswith(("experts.gate_up_proj", "experts.gate_up_proj_bias")):
        return {key: torch.cat([tensor[..., ::2], tensor[..., 1::2]], -1)}
    if key.endswith("experts.down_proj_bias") and rank:
        return {key: torch.zeros_like(tensor)}
    return {key: tensor}
