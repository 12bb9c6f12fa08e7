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
