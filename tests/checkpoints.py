"""Random checkpoints of the newer architectures (Qwen3, Qwen3-MoE, Mixtral), small enough
for the CPU, written by transformers itself; ``fused_copy`` rewrites a mixture in
transformers 5's fused expert layout."""

from __future__ import annotations

import shutil

import torch
from conftest import _write_random_checkpoint
from safetensors.torch import save_file

SMALL = dict(vocab_size=384, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, eos_token_id=1,
             max_position_embeddings=1024, bos_token_id=0, tie_word_embeddings=False)  # fmt: skip


def _qwen3(tmp, **over):
    from transformers import Qwen3Config

    cfg = Qwen3Config(**{**SMALL, "intermediate_size": 96, "num_hidden_layers": 2, "head_dim": 24, **over})
    cfg.architectures = ["Qwen3ForCausalLM"]
    return _write_random_checkpoint(tmp, cfg, seed=21)


def _qwen3_moe(tmp, **over):
    from transformers import Qwen3MoeConfig

    cfg = Qwen3MoeConfig(**{**SMALL, "intermediate_size": 96, "num_hidden_layers": 2, "num_experts": 8,
                            "num_experts_per_tok": 2, "moe_intermediate_size": 32, **over})  # fmt: skip
    cfg.architectures = ["Qwen3MoeForCausalLM"]
    return _write_random_checkpoint(tmp, cfg, seed=22)


def _mistral(tmp, **over):
    from transformers import MistralConfig

    cfg = MistralConfig(**{**SMALL, "intermediate_size": 96, "num_hidden_layers": 2, **over})
    cfg.architectures = ["MistralForCausalLM"]
    return _write_random_checkpoint(tmp, cfg, seed=24)


def _gemma3(tmp, **over):
    from transformers import Gemma3TextConfig

    cfg = Gemma3TextConfig(**{**SMALL, "intermediate_size": 96, "num_hidden_layers": 3, "head_dim": 32,
                              "sliding_window_pattern": 3, "sliding_window": 16, "query_pre_attn_scalar": 24,
                              "tie_word_embeddings": True, **over})  # fmt: skip
    cfg.architectures = ["Gemma3ForCausalLM"]
    return _write_random_checkpoint(tmp, cfg, seed=25)


def _mixtral(tmp, **over):
    from transformers import MixtralConfig

    cfg = MixtralConfig(**{**SMALL, "intermediate_size": 48, "num_hidden_layers": 2, "num_local_experts": 4,
                           "num_experts_per_tok": 2, **over})  # fmt: skip
    cfg.architectures = ["MixtralForCausalLM"]
    return _write_random_checkpoint(tmp, cfg, seed=23)


def _gpt_oss(tmp, **over):
    """gpt-oss: layers alternating a 16-token window and full attention, YaRN, 4 experts
    with biases, top 2. Its sinks scaled up (to N(0, 2)) and its experts' gate and up
    weights too (to N(0, 3)), so that both the sinks and the SwiGLU's clamp at 7 change the
    output of a model this small. (The clamp is left at gpt-oss's 7: transformers before
    5.24 ignores ``swiglu_limit`` and clamps at 7, and the device image has 5.17.)"""
    from transformers import AutoModelForCausalLM, GptOssConfig

    rope = {
        "rope_type": "yarn",
        "factor": 4.0,
        "original_max_position_embeddings": 256,
        "rope_theta": 10000.0,
    }
    cfg = GptOssConfig(**{**SMALL, "intermediate_size": 32, "num_hidden_layers": 3, "num_local_experts": 4,
                          "num_experts_per_tok": 2, "head_dim": 16, "sliding_window": 16,
                          "rope_parameters": rope, **over})  # fmt: skip
    cfg.architectures = ["GptOssForCausalLM"]
    path = _write_random_checkpoint(tmp, cfg, seed=26)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.sinks.mul_(20.0)
            layer.mlp.experts.gate_up_proj.mul_(30.0)
    model.save_pretrained(path)
    return path


def fused_copy(path: str, dest) -> str:
    """The same checkpoint in transformers 5's fused expert layout (what its models hold in
    memory; ``save_pretrained`` still writes a module per expert)."""
    from transformers import AutoModelForCausalLM

    shutil.copytree(path, dest, dirs_exist_ok=True)
    state = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).state_dict()
    assert any(k.endswith("experts.gate_up_proj") for k in state)
    save_file({k: v.contiguous() for k, v in state.items()}, str(dest / "model.safetensors"))
    return str(dest)


MODELS = {
    "qwen3": lambda t: _qwen3(t),
    "qwen3_mha_bias": lambda t: _qwen3(t, num_key_value_heads=4, head_dim=16, attention_bias=True),
    # layer 0 dense (decoder_sparse_step 2), renormalised top-2 of 8
    "qwen3_moe": lambda t: _qwen3_moe(t, decoder_sparse_step=2, norm_topk_prob=True),
    # three layers, the first dense by mlp_only_layers, top-3 of 8 not renormalised
    "qwen3_moe_plain": lambda t: _qwen3_moe(
        t, num_hidden_layers=3, mlp_only_layers=[0], num_experts_per_tok=3
    ),
    "mixtral": lambda t: _mixtral(t),
    "gpt_oss": lambda t: _gpt_oss(t),
}
# Sliding windows shorter than the tests' prompts: every layer (Mistral, Mixtral), or the
# layers from max_window_layers on (Qwen3: layer 1 slides, layer 0 attends to everything).
WINDOWED = {
    "mistral_window": lambda t: _mistral(t, sliding_window=24),
    "qwen3_window": lambda t: _qwen3(t, use_sliding_window=True, sliding_window=20, max_window_layers=1),
    "mixtral_window": lambda t: _mixtral(t, sliding_window=28),
    # two local layers to one global; the global RoPE linearly scaled; logits soft-capped
    "gemma3": lambda t: _gemma3(
        t, rope_scaling={"rope_type": "linear", "factor": 2.0}, final_logit_softcapping=30.0
    ),
    # gpt-oss: a 16-token window on every other layer, attention sinks
    "gpt_oss": lambda t: _gpt_oss(t),
    # Gemma 3's own pattern: five local layers to one global, head_dim 16
    "gemma3_six": lambda t: _gemma3(
        t,
        num_hidden_layers=6,
        sliding_window_pattern=6,
        head_dim=16,
        sliding_window=12,
        query_pre_attn_scalar=16,
    ),
}
