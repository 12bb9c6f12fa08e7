"""Qwen3, Qwen3-MoE and Mixtral: greedy output token-identical to transformers on random
checkpoints of several shapes, under chunked prefill, prefix sharing, preemption and abort;
both checkpoint layouts of the mixtures (a module per expert, as transformers still saves
them, and its fused in-memory layout) load to the same model; loading stays strict."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from checkpoints import MODELS, WINDOWED, _mixtral, fused_copy
from conftest import generate_aborting, random_prompts
from safetensors.torch import save_file

from preble_backend.model.model_config import ModelConfig

GREEDY = {"temperature": 0}


@pytest.fixture(scope="session", params=[*MODELS, "qwen3_moe_fused", "mixtral_fused"])
def arch_model(request, tmp_path_factory) -> str:
    name = request.param.removesuffix("_fused")
    path = MODELS[name](tmp_path_factory.mktemp(name))
    return (
        fused_copy(path, tmp_path_factory.mktemp(request.param)) if request.param.endswith("_fused") else path
    )


def reference(hf_reference, model_path, prompts, max_tokens):
    ref = hf_reference(model_path)
    return [ref.greedy(p, max_tokens) for p in prompts]


def test_mixed_lengths_under_chunked_prefill(arch_model, make_engine, hf_reference):
    engine = make_engine(arch_model, page_size=8, chunk_size=16)
    prompts = random_prompts([3, 90, 17, 41, 1], 384, seed=31)
    assert engine.generate(prompts, {**GREEDY, "max_tokens": 10}) == reference(
        hf_reference, arch_model, prompts, 10
    )


def test_shared_prefix_preemption_and_abort(arch_model, make_engine, hf_reference):
    """A second wave hits the first's prefix pages; a pool of 12 pages forces preemption;
    an abort midway leaves the others exact and every page returned (teardown)."""
    [prefix] = random_prompts([40], 384, seed=32)
    prompts = [prefix + s for s in random_prompts([6, 21, 2, 13], 384, seed=33)]
    expect = reference(hf_reference, arch_model, prompts, 12)
    engine = make_engine(arch_model, page_size=8, chunk_size=16)
    assert engine.generate(prompts[:1], {**GREEDY, "max_tokens": 12}) == expect[:1]
    assert engine.generate(prompts[1:], {**GREEDY, "max_tokens": 12}) == expect[1:]
    assert engine.stats()["prompt_tokens_cached"] == 3 * 40
    assert engine.stats()["chunk_size"] == 16  # a router prices a prefill engine's passes by it
    small = make_engine(arch_model, page_size=8, chunk_size=16, max_num_tokens=96)
    outputs = generate_aborting(small, [*prompts, prefix], {**GREEDY, "max_tokens": 12}, "r4", 5)
    assert [outputs[f"r{i}"] for i in range(4)] == expect and len(outputs.get("r4", [])) < 12
    assert small.stats()["num_preemptions"] > 0


@pytest.fixture(scope="session", params=list(WINDOWED))
def windowed_model(request, tmp_path_factory) -> str:
    return WINDOWED[request.param](tmp_path_factory.mktemp(request.param))


@pytest.mark.parametrize("backend", ["sdpa", "torch", "triton"])
def test_sliding_windows_past_the_window(windowed_model, make_engine, hf_reference, backend):
    """Prompts three to five windows long, under chunked prefill (chunks shorter and longer
    than the window), a shared prefix the second wave hits, and preemption in a pool of 16
    pages: each answer is transformers' own, on every attention backend (Triton's in its
    interpreter here)."""
    [prefix] = random_prompts([64], 384, seed=34)
    prompts = [prefix + s for s in random_prompts([7, 40, 1], 384, seed=35)] + random_prompts(
        [90], 384, seed=36
    )
    expect = reference(hf_reference, windowed_model, prompts, 16)
    for chunk in (16, 48):
        engine = make_engine(windowed_model, page_size=8, chunk_size=chunk, attention_backend=backend)
        assert engine.generate(prompts[:1], {**GREEDY, "max_tokens": 16}) == expect[:1]
        assert engine.generate(prompts[1:], {**GREEDY, "max_tokens": 16}) == expect[1:]
        assert engine.stats()["prompt_tokens_cached"] >= 2 * 64
    small = make_engine(
        windowed_model, page_size=8, chunk_size=16, max_num_tokens=128, attention_backend=backend
    )
    assert small.generate(prompts, {**GREEDY, "max_tokens": 16}) == expect
    assert small.stats()["num_preemptions"] > 0


def sampled_log_probabilities(make_engine, path: str, prompt: list[int]) -> tuple[list[int], torch.Tensor]:
    """Five tokens sampled past the window, and the engine's log probability of each."""
    engine, outputs = make_engine(path, chunk_size=16), []
    engine.add_request("lp", prompt, {"temperature": 1.0, "seed": 3, "max_tokens": 5, "ignore_eos": True,
                                      "logprobs": 1}, outputs.append)  # fmt: skip
    while engine.has_work():
        engine.step()
    tokens = [t for o in outputs for t in o.token_ids]
    steps = [step for o in outputs for step in o.logprobs]
    return tokens, torch.tensor([step[t][0] for t, step in zip(tokens, steps)])


def reference_log_probabilities(model, prompt: list[int], tokens: list[int]) -> torch.Tensor:
    """transformers' log probability of each of ``tokens`` after ``prompt``."""
    with torch.inference_mode():
        logits = model(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1 : -1]
    return torch.log_softmax(logits.float(), dim=-1)[torch.arange(len(tokens)), tokens]


def test_gemma3_log_probabilities_are_its_soft_capped_ones(tmp_path_factory, make_engine, hf_reference):
    """Soft-capping is monotonic, so greedy tokens cannot show it: the log probabilities of
    sampled tokens do, against transformers' own (capped) logits, past the window."""
    path = WINDOWED["gemma3"](tmp_path_factory.mktemp("gemma3_lp"))
    [prompt] = random_prompts([40], 384, seed=37)
    tokens, ours = sampled_log_probabilities(make_engine, path, prompt)
    theirs = reference_log_probabilities(hf_reference(path).model, prompt, tokens)
    assert ours.tolist() == pytest.approx(theirs.tolist(), abs=1e-4)


def test_gpt_oss_log_probabilities_are_its_own_with_sinks_and_clamped_experts(
    tmp_path_factory, make_engine, hf_reference
):
    """Sinks and the clamp shift probabilities more than they flip greedy tokens: the log
    probabilities of sampled tokens equal transformers' (1e-4), past the window, while the
    same checkpoint without its sinks, or unclamped, is off by more than 1e-2 (so the
    comparison sees both)."""
    path = MODELS["gpt_oss"](tmp_path_factory.mktemp("gpt_oss_lp"))
    [prompt] = random_prompts([40], 384, seed=38)
    tokens, ours = sampled_log_probabilities(make_engine, path, prompt)
    model = hf_reference(path).model

    def theirs() -> torch.Tensor:
        return reference_log_probabilities(model, prompt, tokens)

    assert torch.allclose(ours, theirs(), atol=1e-4)
    sinks = [layer.self_attn.sinks.detach().clone() for layer in model.model.layers]
    try:
        for layer in model.model.layers:
            layer.self_attn.sinks.data.fill_(-1e4)
        assert (ours - theirs()).abs().max() > 1e-2
    finally:
        for layer, kept in zip(model.model.layers, sinks):
            layer.self_attn.sinks.data.copy_(kept)
    limit = model.model.layers[0].mlp.experts.limit
    try:
        for layer in model.model.layers:
            layer.mlp.experts.limit = 1e4
        assert (ours - theirs()).abs().max() > 1e-2
    finally:
        for layer in model.model.layers:
            layer.mlp.experts.limit = limit


def test_multimodal_gemma3_is_refused_naming_its_text_model():
    message = "'Gemma3ForConditionalGeneration' is multimodal: serve its text model, Gemma3ForCausalLM"
    with pytest.raises(ValueError, match=message):
        ModelConfig.from_dict({"architectures": ["Gemma3ForConditionalGeneration"]})


def test_the_config_is_read_as_transformers_reads_it(tmp_path_factory):
    moe = ModelConfig.from_dir(MODELS["qwen3_moe_plain"](tmp_path_factory.mktemp("cfg")))
    assert moe.qk_norm and moe.moe.sparse_layers == (1, 2) and moe.moe.top_k == 3
    assert not moe.moe.renormalize and moe.moe.cast_weights and moe.head_dim == 16
    mixtral = ModelConfig.from_dir(MODELS["mixtral"](tmp_path_factory.mktemp("cfg")))
    assert mixtral.moe.renormalize and not mixtral.moe.cast_weights and mixtral.moe.sparse_layers == (0, 1)
    assert not mixtral.qk_norm and mixtral.moe.num_experts == 4 and mixtral.layer_windows == (None, None)
    qwen3 = ModelConfig.from_dir(WINDOWED["qwen3_window"](tmp_path_factory.mktemp("cfg")))
    assert qwen3.layer_windows == (None, 20) and qwen3.max_context == 1024  # the window does not cap it
    # a config.json without tie_word_embeddings takes transformers' default for its family
    for name, tied in (("gemma3", True), ("qwen3_window", False)):
        raw = json.loads((Path(WINDOWED[name](tmp_path_factory.mktemp("tie"))) / "config.json").read_text())
        raw.pop("tie_word_embeddings", None)
        assert ModelConfig.from_dict(raw).tie_word_embeddings is tied


@pytest.mark.parametrize(("key", "value"), [("layer_norm_type", "pre"), ("moe_shared_expert", 1),
                                            ("scoring_func", "sigmoid")])  # fmt: skip
def test_an_unknown_key_that_would_change_the_math_is_refused_by_name(tmp_path_factory, key, value):
    path = tmp_path_factory.mktemp("strict")
    _mixtral(path)
    cfg = json.loads((path / "config.json").read_text())
    with pytest.raises(ValueError, match=f"{key} are not implemented for mixtral"):
        ModelConfig.from_dict({**cfg, key: value})


@pytest.mark.parametrize(("key", "value"), [("attn_logit_softcapping", 50.0),
                                            ("use_bidirectional_attention", True)])  # fmt: skip
def test_gemma3_settings_not_built_are_refused_by_name(tmp_path_factory, key, value):
    path = Path(WINDOWED["gemma3"](tmp_path_factory.mktemp("gstrict")))
    cfg = json.loads((path / "config.json").read_text())
    ModelConfig.from_dict(cfg)  # as transformers writes it: loads
    with pytest.raises(ValueError, match=rf"field\(s\) {key} are not implemented for gemma3"):
        ModelConfig.from_dict({**cfg, key: value})


def test_a_checkpoint_missing_an_expert_is_refused(tmp_path_factory, make_engine):
    from safetensors.torch import load_file

    path = tmp_path_factory.mktemp("missing")
    _mixtral(path)
    state = load_file(str(path / "model.safetensors"))
    del state["model.layers.1.block_sparse_moe.experts.3.w2.weight"]
    save_file(state, str(path / "model.safetensors"))
    with pytest.raises(ValueError, match="lacks layers.1's down of expert 3"):
        make_engine(str(path))


def test_the_model_card_reports_the_architecture_active_parameters_and_kv_bytes(tmp_path_factory):
    """Computed by hand from the test shapes: Qwen3-MoE's 8 experts of (3 x 64 x 32) on
    one of its two layers, 2 of them per token (the others' 6 / 8 not run); Gemma 3's 2 KV
    heads of 16 on 6 layers."""
    from preble_backend.model.model_card import model_card

    moe = Path(MODELS["qwen3_moe"](tmp_path_factory.mktemp("card")))
    card = model_card(str(moe), moe)
    experts = 8 * 3 * 64 * 32
    assert (
        card.architecture == "Qwen3MoeForCausalLM"
        and card.active_parameters == card.parameters - experts * 6 // 8
    )
    assert card.kv_bytes_per_token == 2 * 2 * 2 * 16 * 4  # K and V, 2 layers, 2 KV heads of 64 / 4, fp32
    assert f"({card.active_parameters / 1e6:.1f}M active per token)" in card.line()
    gemma = Path(WINDOWED["gemma3_six"](tmp_path_factory.mktemp("card")))
    card = model_card(str(gemma), gemma, dtype="bfloat16")
    assert card.kv_bytes_per_token == 2 * 6 * 2 * 16 * 2 and card.active_parameters == card.parameters
    assert "Gemma3ForCausalLM, KV 0.8 KiB per token, 5 of 6 layers slide over 12 tokens" in card.line()
