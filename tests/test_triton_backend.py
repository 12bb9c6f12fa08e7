"""The engine's ``triton`` attention backend (Triton's interpreter on CPU) against the
``torch`` backend: the same forwards give the same logits, cascade included, and the
groups come from pages the radix cache shares."""

from __future__ import annotations

import pytest
import torch
from conftest import random_prompts

from preble_backend.model.attention import shared_prefix_groups

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # the interpreter runs the kernels on CPU
SHARED = 300  # above CASCADE_MIN_SHARED_TOKENS, not a multiple of the page size


@pytest.fixture
def cascade_at_the_default(monkeypatch):
    """A GPU with a measured crossover (16k on sm_90) would send these short prefixes down
    plain attention; the default threshold makes the cascade path run on every device."""
    from preble_backend.model import attention_triton

    monkeypatch.setattr(attention_triton, "CASCADE_THRESHOLDS", {})


@pytest.fixture(scope="module")
def one_layer_model(tmp_path_factory) -> str:
    """One decoder layer, GQA 4:1, head_dim 64."""
    from conftest import _write_random_checkpoint
    from transformers import LlamaConfig

    cfg = LlamaConfig(
        vocab_size=512, hidden_size=512, intermediate_size=512, num_hidden_layers=1,
        num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=1024,
        eos_token_id=1, bos_token_id=0,
    )  # fmt: skip
    cfg.architectures = ["LlamaForCausalLM"]
    return _write_random_checkpoint(tmp_path_factory.mktemp("one-layer"), cfg, seed=21)


def record_logits(engine) -> list[torch.Tensor]:
    seen, forward = [], engine.runner.forward

    def recording(batch, pool):
        logits, rows = forward(batch, pool)
        seen.append(logits.clone())
        return logits, rows

    engine.runner.forward = recording
    return seen


def test_triton_backend_equals_torch_backend(make_engine, one_layer_model, cascade_at_the_default):
    shared = random_prompts([SHARED], 512, seed=1)[0]
    suffixes = random_prompts([9, 1, 23, 40], 512, seed=2)
    loner = random_prompts([37], 512, seed=3)[0]
    params = {"max_tokens": 6, "temperature": 0.0, "ignore_eos": True}
    results = {}
    for backend in ("torch", "triton"):
        engine = make_engine(
            one_layer_model, attention_backend=backend, page_size=16, chunk_size=128, device=DEVICE
        )
        logits = record_logits(engine)
        warm = engine.generate([shared + [5]], params)  # puts the shared prefix in the radix cache
        batch = engine.generate([shared + s for s in suffixes] + [loner], params)
        results[backend] = (warm, batch, logits, getattr(engine.runner.backend, "cascade_forwards", None))
    assert results["triton"][:2] == results["torch"][:2]
    torch_logits, triton_logits = results["torch"][2], results["triton"][2]
    assert len(torch_logits) == len(triton_logits) > 10
    for a, b in zip(torch_logits, triton_logits):  # fp32 on both sides: relative error < 1e-5
        assert a.shape == b.shape
        if a.numel():  # a forward of prefill chunks only samples nothing
            assert (a - b).abs().max() / a.abs().max() < 1e-5, (a - b).abs().max()
    # The second batch ran prefill chunks and decodes as cascades over the cached prefix.
    assert results["triton"][3] >= 6


def test_shared_prefix_groups_follow_cached_pages():
    # Requests 0, 1, 3 share pages 4, 9, 2 (and 0 and 3 also 7); 2 starts elsewhere and
    # 4 holds one page, too few tokens to be considered at 32.
    tree_pages = [[4, 9, 2, 7], [4, 9, 2], [5, 6, 8], [4, 9, 2, 7, 1], [11]]
    assert shared_prefix_groups(tree_pages, 16, 32) == [([0, 1, 3], 48)]
    # At 64 tokens request 1 (48 cached) drops out and 0 and 3 share all four pages.
    assert shared_prefix_groups(tree_pages, 16, 64) == [([0, 3], 64)]
    diverging = [[4, 9, 2, 7], [4, 9, 3, 7], [4, 9, 2, 7]]
    assert shared_prefix_groups(diverging, 16, 16) == [([0, 1, 2], 32)]


def test_triton_backend_on_cpu_needs_the_interpreter(one_layer_model, monkeypatch):
    from preble_backend.model.attention_triton import TritonAttention

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match="needs a CUDA device"):
        TritonAttention(torch.device("cpu"))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="the GPU backends need CUDA")
@pytest.mark.parametrize("backend,dtype", [("triton", "float32"), ("flashinfer", "bfloat16")])
def test_gpu_backends_equal_torch_backend(make_engine, one_layer_model, backend, dtype):
    """On CUDA each backend gives the torch backend's logits: to 1e-4 in fp32; in bf16
    (FlashInfer has no fp32 kernels) to 3% of the largest logit, where a wrong attention
    would be off by the logits' own size."""
    if backend == "flashinfer":
        pytest.importorskip("flashinfer", reason="flashinfer-python is not installed")
    shared = random_prompts([SHARED], 512, seed=1)[0]
    prompts = [shared + s for s in random_prompts([9, 1, 23, 40], 512, seed=2)]
    params = {"max_tokens": 6, "temperature": 0.0, "ignore_eos": True}
    logits = {}
    for name in ("torch", backend):
        engine = make_engine(one_layer_model, attention_backend=name, device="cuda", dtype=dtype)
        logits[name] = record_logits(engine)
        engine.generate([shared + [5]], params)
        engine.generate(prompts, params)
    assert len(logits["torch"]) == len(logits[backend]) > 6
    for a, b in zip(logits["torch"], logits[backend]):
        if dtype == "float32":
            assert torch.allclose(a, b, rtol=1e-4, atol=1e-4), (a - b).abs().max()
        elif a.numel():
            assert (a.float() - b.float()).abs().max() / a.float().abs().max() < 3e-2
            if not torch.equal(a.argmax(-1), b.argmax(-1)):
                break  # bf16 rounding picked another token: later forwards see other inputs


def test_auto_backend_is_sdpa_on_cpu_and_unknown_names_are_refused():
    from preble_backend.model.attention import TorchAttention
    from preble_backend.model.attention_backends import make_attention_backend
    from preble_backend.model.attention_sdpa import SdpaAttention

    assert isinstance(make_attention_backend("auto", torch.device("cpu")), SdpaAttention)
    assert isinstance(make_attention_backend("torch", torch.device("cpu")), TorchAttention)
    with pytest.raises(ValueError, match="accepted: auto, torch, sdpa, triton, flashinfer"):
        make_attention_backend("cuda_magic", torch.device("cpu"))
    with pytest.raises(ValueError, match="'flashinfer' needs a CUDA device"):
        make_attention_backend("flashinfer", torch.device("cpu"))


def test_backend_benchmark_runs_and_its_backends_agree_with_transformers(capsys):
    """The GPU engine benchmark's code paths on tiny shapes: every backend it can run here
    gives transformers' greedy tokens, and its table has a row per backend."""
    from preble_backend.benchmarks.attention_backends import main

    assert main(["--smoke", "--backends", "torch,triton"]) == 0
    table = capsys.readouterr().out.split("| backend |")[1]
    for backend in ("torch", "triton"):
        row = next(line for line in table.splitlines() if line.startswith(f"| {backend} |"))
        assert "| 2/2 (mean 4.0) |" in row, row


def test_warm_up_leaves_the_engine_as_it_found_it(make_engine, one_layer_model, cascade_at_the_default):
    """The GPU engine model's warm-up (here through Triton's interpreter): it runs a
    cascade, then every page is back, the counters read zero, and answers are unchanged."""
    prompts = random_prompts([40, 300], 512, seed=4)
    params = {"max_tokens": 5, "temperature": 0.0, "ignore_eos": True}
    fresh = make_engine(one_layer_model, attention_backend="triton", device=DEVICE)
    expected = fresh.generate(prompts, params)
    warmed = make_engine(one_layer_model, attention_backend="triton", device=DEVICE)
    warmed.warm_up()
    assert warmed.runner.backend.cascade_forwards > 0
    stats = warmed.stats()
    assert stats["kv_pages_used"] == 0 and stats["requests_finished"] == 0
    assert stats["prompt_tokens_computed"] == 0
    assert warmed.generate(prompts, params) == expected


def test_the_cascade_threshold_is_the_measured_crossover_of_the_device(monkeypatch):
    """An H100 (sm_90) sends a group through cascade from 16k shared tokens, where
    KERNELS.md's decode measurements cross; a GPU never measured, and the CPU
    (interpreter), from the default 256."""
    from preble_backend.model import attention_triton
    from preble_backend.model.attention_triton import CASCADE_MIN_SHARED_TOKENS, cascade_threshold

    assert cascade_threshold(torch.device("cpu")) == CASCADE_MIN_SHARED_TOKENS == 256
    for capability, expected in (((9, 0), 16384), ((8, 0), 256), ((8, 9), 256)):
        monkeypatch.setattr(attention_triton.torch.cuda, "get_device_capability", lambda d, c=capability: c)
        assert cascade_threshold(torch.device("cuda:0")) == expected
