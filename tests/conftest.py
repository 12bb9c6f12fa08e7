"""Shared fixtures: small random-init checkpoints written by the tests themselves, Hugging
Face reference generation, and engines whose every KV page is checked at teardown."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

torch.set_num_threads(2)
# Without a GPU the Triton kernels run in Triton's interpreter; it is chosen when a kernel
# is decorated, so this must precede every import of ``kernels``.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
# PREBLE_TEST_DEVICE=cuda runs every engine the tests build on the GPU (in fp32, so the
# parity suites still hold token for token); the references stay on the CPU.
TEST_DEVICE = os.environ.get("PREBLE_TEST_DEVICE", "cpu")


@pytest.fixture(scope="session", autouse=True)
def _preble_cache(tmp_path_factory):
    """The tiny model is written once per session into a private cache."""
    os.environ["PREBLE_CACHE"] = str(tmp_path_factory.mktemp("preble-cache"))


@pytest.fixture(scope="session")
def tiny_model(_preble_cache) -> str:
    from preble_backend.model.tiny_model import tiny_model_path

    return str(tiny_model_path())


def _write_random_checkpoint(path: Path, config, seed: int) -> str:
    """Save a Hugging Face model of ``config`` with seeded N(0, 0.1) weights (norms at 1)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.fill_(1.0)
            else:
                param.copy_(torch.randn(param.shape, generator=gen) * 0.1)
    model.save_pretrained(path, safe_serialization=True)
    return str(path)


@pytest.fixture(scope="session")
def qwen2_gqa_model(tmp_path_factory) -> str:
    """Qwen2-style: qkv bias, GQA 4:1, untied embeddings."""
    from transformers import Qwen2Config

    cfg = Qwen2Config(
        vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
        num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=1024,
        tie_word_embeddings=False, eos_token_id=1, bos_token_id=0,
    )  # fmt: skip
    cfg.architectures = ["Qwen2ForCausalLM"]
    return _write_random_checkpoint(tmp_path_factory.mktemp("qwen2"), cfg, seed=11)


@pytest.fixture(scope="session")
def llama3_tied_model(tmp_path_factory) -> str:
    """Llama-3 rope scaling, tied embeddings, GQA 2:1, head_dim 32."""
    from transformers import LlamaConfig

    cfg = LlamaConfig(
        vocab_size=384, hidden_size=128, intermediate_size=320, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
        tie_word_embeddings=True, eos_token_id=1, bos_token_id=0, rope_theta=500000.0,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                      "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
    )  # fmt: skip
    cfg.architectures = ["LlamaForCausalLM"]
    return _write_random_checkpoint(tmp_path_factory.mktemp("llama3"), cfg, seed=12)


@pytest.fixture(scope="session")
def llama_bias_model(tmp_path_factory) -> str:
    """Llama with ``attention_bias`` (q, k, v and o) and ``mlp_bias`` (gate, up, down)."""
    from transformers import LlamaConfig

    cfg = LlamaConfig(
        vocab_size=320, hidden_size=96, intermediate_size=192, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
        attention_bias=True, mlp_bias=True, eos_token_id=1, bos_token_id=0,
    )  # fmt: skip
    cfg.architectures = ["LlamaForCausalLM"]
    return _write_random_checkpoint(tmp_path_factory.mktemp("llama_bias"), cfg, seed=13)


@pytest.fixture(scope="session", params=["tiny", "qwen2_gqa", "llama3_tied"])
def any_model(request) -> str:
    return request.getfixturevalue({"tiny": "tiny_model", "qwen2_gqa": "qwen2_gqa_model",
                                    "llama3_tied": "llama3_tied_model"}[request.param])  # fmt: skip


class HFReference:
    """Greedy continuations from transformers' own ``generate``, memoized per prompt."""

    _models: dict[str, torch.nn.Module] = {}

    def __init__(self, model_path: str) -> None:
        from transformers import AutoModelForCausalLM

        if model_path not in self._models:
            model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
            self._models[model_path] = model.eval()
        self.model = self._models[model_path]

    @torch.inference_mode()
    def greedy(self, prompt: list[int], max_tokens: int) -> list[int]:
        ids = torch.tensor([prompt])
        out = self.model.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_tokens,
            do_sample=False, pad_token_id=self.model.config.eos_token_id,
        )  # fmt: skip
        return out[0, len(prompt) :].tolist()


@pytest.fixture
def hf_reference():
    return HFReference


@pytest.fixture
def make_engine():
    """Build engines; at teardown each must hold no request and, after the unreferenced
    cache is flushed, have every KV page back on the free list."""
    from preble_backend.engine.config import EngineConfig
    from preble_backend.engine.engine import Engine

    engines: list[Engine] = []

    def build(model_path: str, **overrides) -> Engine:
        # A fixed KV capacity (the CPU default): on a GPU the default takes 85% of free
        # memory, and test processes running side by side would starve each other.
        overrides = {"device": TEST_DEVICE, "dtype": "float32", "max_num_tokens": 32768, **overrides}
        engine = Engine(EngineConfig(model_path=model_path, **overrides))
        engines.append(engine)
        return engine

    yield build
    for engine in engines:
        engine.shutdown()
        assert_all_pages_free(engine)


def assert_all_pages_free(engine) -> None:
    stats = engine.stats()
    assert stats["running"] == 0 and stats["waiting"] == 0, stats
    if engine.cache is not None:
        assert engine.cache.num_locked_pages == 0
        assert stats["kv_pages_used"] == stats["kv_pages_cached"], stats
    engine.flush_cache()
    assert engine.pool.num_free == engine.pool.num_pages
    assert len(set(engine.pool._free)) == engine.pool.num_pages  # no page freed twice
    window = engine.pool.window
    if window is not None:  # the sliding layers' pool too: every window page back, none needed
        assert window.num_free == window.num_pages and len(set(window._free)) == window.num_pages
        assert not any(engine.scheduler.blocks.windows.need) and not engine.scheduler.blocks.windows.idle
    host = engine.cache.host if engine.cache is not None else None
    if host is not None:  # the host tier's pages too
        assert engine.cache.num_host_pages == 0 and host.pool.num_free == host.pool.num_pages
        assert len(set(host.pool._free)) == host.pool.num_pages


def generate_aborting(engine, prompts, params: dict, abort: str, after_steps: int) -> dict[str, list[int]]:
    """Each prompt added as request ``r{i}``; ``abort`` aborted after ``after_steps`` steps;
    then every step to the end. Returns each request's tokens."""
    outputs: dict[str, list[int]] = {}

    def collect(out) -> None:
        outputs.setdefault(out.request_id, []).extend(out.token_ids)

    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}", prompt, params, collect)
    for _ in range(after_steps):
        engine.step()
    engine.abort(abort)
    while engine.has_work():
        engine.step()
    return outputs


def random_prompts(lengths, vocab: int, seed: int = 0, low: int = 3) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(low, vocab, (n,), generator=gen).tolist() for n in lengths]


def make_request(tokens: list[int], rid: int | str = 0):
    from preble_backend.common.sampling_params import SamplingParams
    from preble_backend.engine.outputs.sampling import SamplerState
    from preble_backend.engine.scheduling.request import Request

    params = SamplingParams(max_tokens=1)
    return Request(str(rid), list(tokens), params, SamplerState.create(params, "cpu"))


def tiny_pool(num_pages: int = 24, page_size: int = 4):
    """A KV pool with one-number pages: for tests of page bookkeeping alone."""
    from preble_backend.model.kv_pool import KVPool

    return KVPool(num_pages, page_size, num_layers=1, num_kv_heads=1, head_dim=1, dtype=torch.float32)


def assert_cached_kids_counted(tree) -> None:
    """Every node of a global prefix tree counts, per instance, the children it caches."""
    stack = [tree.root]
    while stack:
        node = stack.pop()
        counts: dict[int, int] = {}
        for child in node.children.values():
            for i in child.cached:
                counts[i] = counts.get(i, 0) + 1
            stack.append(child)
        assert node.cached_kids == counts


@pytest.fixture(scope="module")
def stack(tmp_path_factory, tiny_model):
    """``preble serve`` on a repository of two CPU engines, shared by a module's tests (a
    module may define its own)."""
    from server_utils import serve_stack, write_test_repository

    stack = serve_stack(write_test_repository(tmp_path_factory.mktemp("served") / "repo", cpu_engines=2))
    yield stack
    stack.stop()
