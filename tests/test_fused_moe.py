"""The fused MoE kernel (``kernels/fused_moe.py``) against its float64 reference, under
TRITON_INTERPRET=1 on the CPU (on a GPU host, on the card): tokens sorted by expert with
padding to the block size, experts that receive no token, a single token, top-1 to top-4,
shapes that no block divides, experts with biases and gpt-oss's clamped SwiGLU; and
against the engine's own MoE layer."""

from __future__ import annotations

import pytest
import torch

from kernels import fused_moe
from kernels import reference as ref
from kernels.fused_moe import align_block_size

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOL = {torch.float32: 1e-5, torch.float16: 3e-3, torch.bfloat16: 2e-2}


def routed(tokens, hidden, inter, experts, top_k, seed, skip=()):
    """Random weights and a router's choice: distinct experts per token, none from ``skip``."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=gen, dtype=torch.float64)
    gate_up = torch.randn(experts, 2 * inter, hidden, generator=gen, dtype=torch.float64) / hidden**0.5
    down = torch.randn(experts, hidden, inter, generator=gen, dtype=torch.float64) / inter**0.5
    allowed = torch.tensor([e for e in range(experts) if e not in skip])
    ids = torch.stack([allowed[torch.randperm(len(allowed), generator=gen)[:top_k]] for _ in range(tokens)])
    weights = torch.softmax(torch.randn(tokens, top_k, generator=gen, dtype=torch.float64), -1)
    return x, gate_up, down, weights, ids


def test_align_sorts_pairs_by_expert_and_pads_each_to_the_block():
    ids = torch.tensor([[2, 0], [2, 3], [0, 2]])  # pairs 0..5; expert 1 gets none
    sorted_ids, expert_of_block, total = align_block_size(ids, num_experts=4, block_m=4)
    pad = 6
    assert total == 12 and sorted_ids.tolist() == [1, 4, pad, pad, 0, 2, 5, pad, 3, pad, pad, pad]
    assert expert_of_block.tolist() == [0, 2, 3]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize(("tokens", "top_k", "experts"), [(1, 1, 4), (7, 2, 8), (33, 4, 6), (20, 2, 16)])
def test_fused_moe_matches_reference(dtype, tokens, top_k, experts):
    x, gate_up, down, weights, ids = routed(tokens, 40, 24, experts, top_k, seed=tokens, skip=(1,))
    low = [t.to(dtype) for t in (x, gate_up, down)]
    out = fused_moe(*(t.to(DEVICE) for t in low), weights.float().to(DEVICE), ids.to(DEVICE))
    expect = ref.fused_moe_ref(*(t.double() for t in low), weights.float().double(), ids)
    assert out.dtype == dtype and out.shape == x.shape
    assert ((out.double().cpu() - expect).abs().max() / expect.abs().max()).item() < TOL[dtype]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_fused_moe_with_expert_biases_and_a_clamped_glu(dtype):
    """gpt-oss's experts: each expert's bias added in the kernel after either projection,
    and its clamped SwiGLU between them (clamped at 0.5, which these inputs exceed)."""
    from preble_backend.model.activations import clamped_swiglu

    x, gate_up, down, weights, ids = routed(19, 40, 24, 6, 2, seed=5)
    gen = torch.Generator().manual_seed(6)
    biases = [torch.randn(6, n, generator=gen, dtype=torch.float64) for n in (48, 40)]
    glu = clamped_swiglu(0.5, 1.702)
    low = [t.to(dtype) for t in (x, gate_up, down, *biases)]
    out = fused_moe(*(t.to(DEVICE) for t in low[:3]), weights.float().to(DEVICE), ids.to(DEVICE), glu,
                    *(b.to(DEVICE) for b in low[3:]))  # fmt: skip
    d = [t.double() for t in low]
    expect = ref.fused_moe_ref(*d[:3], weights.double(), ids, glu, *d[3:])
    assert ((out.double().cpu() - expect).abs().max() / expect.abs().max()).item() < TOL[dtype]
    unbiased = ref.fused_moe_ref(*d[:3], weights.double(), ids, glu)
    assert (unbiased - expect).abs().max() > 0.1  # the biases matter here


def _layer(gpt_oss: bool = False):
    """A Mixtral mixture, or gpt-oss's (its router, biases, clamped SwiGLU, and its experts
    held input-major)."""
    from preble_backend.model.model_config import ModelConfig, MoESpec
    from preble_backend.model.moe import SparseMoE

    spec = MoESpec(num_experts=8, top_k=2, intermediate_size=24, renormalize=True, cast_weights=False,
                   sparse_layers=(0,))  # fmt: skip
    if gpt_oss:
        spec = MoESpec(8, 2, 24, renormalize=False, cast_weights=True, sparse_layers=(0,),
                       router="topk_softmax", bias=True, swiglu_limit=0.5, interleaved=True)  # fmt: skip
    cfg = ModelConfig("mixtral", 64, 32, 48, 1, 4, 2, 8, 128, 1e-6, "silu", *[False] * 4, moe=spec)
    torch.manual_seed(0)
    layer = SparseMoE(cfg)
    for p in layer.parameters():
        torch.nn.init.normal_(p, std=0.2)
    return layer


@pytest.mark.parametrize("gpt_oss", [False, True], ids=["mixtral", "gpt_oss"])
def test_the_cpu_layers_grouped_product_and_its_loop_agree(monkeypatch, gpt_oss):
    """The grouped product (torch 2.11 on) and the loop over experts (older torch)."""
    from preble_backend.model import moe

    layer, x = _layer(gpt_oss), torch.randn(13, 32)
    with torch.no_grad():
        grouped = layer(x)
        monkeypatch.setattr(moe, "GROUPED_MM", None)
        assert torch.allclose(layer(x), grouped, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("gpt_oss", [False, True], ids=["mixtral", "gpt_oss"])
def test_fused_moe_is_the_engines_moe_layer(gpt_oss):
    """The kernel, given the engine's own router and expert weights, gives the layer's output
    (the CPU engine runs transformers' grouped product; a GPU engine runs this kernel);
    gpt-oss's input-major experts reach it as transposed views, read by their strides."""
    layer = _layer(gpt_oss)
    x = torch.randn(9, 32)
    weights, ids = layer.gate(x)
    experts = [w.detach().to(DEVICE) for w in layer.experts.weights()]
    biases = [b.detach().to(DEVICE) for b in (layer.experts.gate_up_proj_bias, layer.experts.down_proj_bias)
              if b is not None]  # fmt: skip
    out = fused_moe(x.to(DEVICE), *experts, weights.to(DEVICE), ids.to(DEVICE), layer.experts.glu, *biases)
    with torch.no_grad():
        assert torch.allclose(out.cpu(), layer(x), rtol=1e-4, atol=1e-5)
