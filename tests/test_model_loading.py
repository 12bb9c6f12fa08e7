"""Every checkpoint either loads exactly or is refused by name: biases Llama declares are
built, a tensor the model would not use and a config field it does not implement are
errors, never silently dropped."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from conftest import random_prompts
from safetensors.torch import load_file, save_file

from preble_backend.model.llama import LlamaForCausalLM
from preble_backend.model.model_config import ModelConfig

GREEDY = {"temperature": 0}


def test_llama_attention_and_mlp_biases_match_transformers(llama_bias_model, make_engine, hf_reference):
    cfg = ModelConfig.from_dir(llama_bias_model)
    assert (cfg.qkv_bias, cfg.o_bias, cfg.mlp_bias) == (True, True, True)
    engine = make_engine(llama_bias_model, page_size=8)
    prompts = random_prompts([23, 5, 40], 320, seed=30)
    out = engine.generate(prompts, {**GREEDY, "max_tokens": 16, "ignore_eos": True})
    ref = hf_reference(llama_bias_model)
    assert out == [ref.greedy(p, 16) for p in prompts]


def _copy(src: str, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def test_a_tensor_the_model_does_not_use_is_refused(llama3_tied_model, tmp_path):
    path = _copy(llama3_tied_model, tmp_path / "extra")
    [weights] = path.glob("*.safetensors")
    state = load_file(str(weights))
    state["model.layers.0.self_attn.o_proj.bias"] = torch.zeros(128)  # a bias the config denies
    save_file(state, str(weights), metadata={"format": "pt"})
    unused = r"weights the model does not use: \['layers.0.self_attn.o_proj.bias'\]"
    with pytest.raises(ValueError, match=unused):
        LlamaForCausalLM.from_pretrained(path, torch.float32, "cpu")


@pytest.mark.parametrize(
    "field, value, message",
    [
        ("quantization_config", {"quant_method": "gptq"}, "quantization_config"),
        ("attn_logit_softcapping", 50.0, "attn_logit_softcapping"),
        ("mlp_bias", True, "mlp_bias are not implemented for qwen2"),
        ("layer_types", ["full_attention", "chunked_attention"], "layer_types"),
    ],
)
def test_a_config_field_that_would_change_the_arithmetic_is_refused(qwen2_gqa_model, field, value, message):
    cfg = json.loads((Path(qwen2_gqa_model) / "config.json").read_text())
    with pytest.raises(ValueError, match=message):
        ModelConfig.from_dict({**cfg, field: value})
    ModelConfig.from_dict({**cfg, field: None})  # off: nothing changes


def test_fields_without_effect_on_inference_are_accepted(qwen2_gqa_model):
    cfg = json.loads((Path(qwen2_gqa_model) / "config.json").read_text())
    extra = {"attention_dropout": 0.1, "initializer_range": 0.05, "use_cache": False,
             "torch_dtype": "bfloat16", "num_beams": 4, "temperature": 0.7, "pad_token_id": 3,
             "_model_name_or_path": "SmolLM2 135M"}  # what transformers' GGUF loader adds  # fmt: skip
    assert ModelConfig.from_dict({**cfg, **extra}).num_kv_heads == 2


def _with_config(src: str, dst: Path, **changes) -> Path:
    path = _copy(src, dst)
    cfg = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**cfg, **changes}))
    return path


def test_rope_scaling_beside_rope_parameters_is_honoured_as_transformers_does(
    llama3_tied_model, tmp_path, make_engine, hf_reference
):  # fmt: skip
    """transformers 5 writes ``rope_parameters``; a model card's ``rope_scaling`` added to
    such a config replaces it there, so here too (it was ignored: every token differed)."""
    cfg = json.loads((Path(llama3_tied_model) / "config.json").read_text())
    theta = cfg.get("rope_theta", 500000.0)
    default, linear = {"rope_type": "default", "rope_theta": theta}, {"rope_type": "linear", "factor": 4.0}
    path = _with_config(llama3_tied_model, tmp_path / "scaled", rope_parameters=default, rope_scaling=linear)
    assert ModelConfig.from_dir(path).rope["rope_type"] == "linear"
    prompts = random_prompts([30, 9], 320, seed=41)
    out = make_engine(str(path)).generate(prompts, {**GREEDY, "max_tokens": 12, "ignore_eos": True})
    assert out == [hf_reference(str(path)).greedy(p, 12) for p in prompts]
    yarn = {
        "rope_type": "yarn",
        "factor": 4.0,
        "original_max_position_embeddings": 256,
    }  # Qwen3's long-context card
    path = _with_config(llama3_tied_model, tmp_path / "yarn", rope_parameters=default, rope_scaling=yarn)
    out = make_engine(str(path)).generate(prompts, {**GREEDY, "max_tokens": 12, "ignore_eos": True})
    assert out == [hf_reference(str(path)).greedy(p, 12) for p in prompts]
    for kind in ("dynamic", "longrope"):
        with pytest.raises(ValueError, match=f"rope_scaling rope_type '{kind}' is not supported"):
            ModelConfig.from_dict({**cfg, "rope_parameters": {"rope_type": "default", "rope_theta": theta},
                                   "rope_scaling": {"rope_type": kind, "factor": 2.0}})  # fmt: skip


def test_an_untied_checkpoint_without_lm_head_is_refused(qwen2_gqa_model, tmp_path):
    path = _copy(qwen2_gqa_model, tmp_path / "headless")
    [weights] = path.glob("*.safetensors")
    state = load_file(str(weights))
    del state["lm_head.weight"]
    save_file(state, str(weights), metadata={"format": "pt"})
    missing = r"lacks weights: \['lm_head.weight'\] \(tie_word_embeddings is false\)"
    with pytest.raises(ValueError, match=missing):
        LlamaForCausalLM.from_pretrained(path, torch.float32, "cpu")


def test_only_the_checkpoints_own_safetensors_are_read(qwen2_gqa_model, tmp_path, make_engine):
    """A second file beside ``model.safetensors`` (an adapter, a copy) is not read, as
    transformers does not read it; several files and no index are refused by name."""
    path = _copy(qwen2_gqa_model, tmp_path / "beside")
    [weights] = path.glob("*.safetensors")
    assert weights.name == "model.safetensors"
    prompts = random_prompts([12], 320, seed=5)
    before = make_engine(str(path)).generate(prompts, {**GREEDY, "max_tokens": 8, "ignore_eos": True})
    state = load_file(str(weights))
    save_file({k: torch.zeros_like(v) for k, v in state.items()}, str(path / "adapter.safetensors"))
    after = make_engine(str(path)).generate(prompts, {**GREEDY, "max_tokens": 8, "ignore_eos": True})
    assert after == before
    weights.rename(path / "weights-a.safetensors")
    with pytest.raises(ValueError, match="has 2 .safetensors files .* and no model.safetensors.index.json"):
        LlamaForCausalLM.from_pretrained(path, torch.float32, "cpu")


def test_a_prompt_past_a_qwen2_sliding_window_is_served_exactly(qwen2_gqa_model, tmp_path, make_engine,
                                                                hf_reference):  # fmt: skip
    """Qwen2's ``use_sliding_window``: the layers from ``max_window_layers`` on slide (here
    the second); a prompt of five windows gets transformers' answer, no longer refused."""
    path = _with_config(qwen2_gqa_model, tmp_path / "window", use_sliding_window=True, sliding_window=16,
                        max_window_layers=1)  # fmt: skip
    prompts = random_prompts([80], 320, seed=6)
    out = make_engine(str(path), chunk_size=32).generate(prompts, {**GREEDY, "max_tokens": 12})
    assert out == [hf_reference(str(path)).greedy(prompts[0], 12)]
