"""Decode steps through CUDA graphs' fixed buffers (``model/decode_graphs.py``). On the CPU
there is nothing to capture, so the same padded, buffer-reading step runs eagerly under
Triton's interpreter: its tokens must be transformers', its logits and KV the eager
path's, whatever bucket a batch pads to. On a GPU the graphs are captured and replayed."""

from __future__ import annotations

import pytest
import torch
from conftest import random_prompts

from preble_backend.model.attention import AttentionBatch
from preble_backend.model.decode_graphs import DecodeGraphs, batch_buckets

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# Requests of several lengths, prefilled in one forward, that finish at different steps: the
# decode batch shrinks 5 -> 4 -> 3 -> 2, padded to buckets 8 and 4 on the way.
LENGTHS = (7, 30, 19, 44, 12)
MAX_TOKENS = (3, 9, 6, 9, 4)


def test_batch_sizes_captured():
    assert batch_buckets(1) == [1]
    assert batch_buckets(3) == [1, 2, 3]
    assert batch_buckets(8) == [1, 2, 4, 8]
    assert batch_buckets(20) == [1, 2, 4, 8, 16, 20]
    assert batch_buckets(64) == [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64]


def run(engine, prompts: list[list[int]]) -> tuple[list[list[int]], list[torch.Tensor], list[int]]:
    """Each prompt with its own ``MAX_TOKENS``, greedy: the outputs, every forward's sampled
    logits, and the sizes of the batches that were decodes alone."""
    seen, decodes, forward = [], [], engine.runner.forward

    def recording(batch, pool):
        logits, rows = forward(batch, pool)
        seen.append(logits.detach().clone().cpu())
        if all(n == 1 for n in batch.num_new_tokens):
            decodes.append(len(batch.requests))
        return logits, rows

    engine.runner.forward = recording
    outputs: dict[int, list[int]] = {i: [] for i in range(len(prompts))}
    for i, (prompt, n) in enumerate(zip(prompts, MAX_TOKENS)):
        params = {"max_tokens": n, "temperature": 0.0, "ignore_eos": True}
        collect = lambda out: outputs[int(out.request_id)].extend(out.token_ids)  # noqa: E731
        engine.add_request(str(i), prompt, params, collect)
    while engine.has_work():
        engine.step()
    return [outputs[i] for i in range(len(prompts))], seen, decodes


@pytest.fixture(scope="module")
def gpt_oss_model(tmp_path_factory) -> str:
    """Sliding layers (their KV in the window pool, read through buffers of their own) and sinks."""
    from checkpoints import MODELS

    return MODELS["gpt_oss"](tmp_path_factory.mktemp("gpt_oss_graphs"))


@pytest.mark.parametrize("model", ["qwen2_gqa_model", "llama3_tied_model", "gpt_oss_model"])
def test_padded_decode_steps_give_the_eager_steps_and_transformers_tokens(request, make_engine, hf_reference,
                                                                          model):  # fmt: skip
    path = request.getfixturevalue(model)
    vocab = 384
    prompts = random_prompts(LENGTHS, vocab, seed=5)
    config = {"attention_backend": "triton", "device": DEVICE, "chunk_size": 128, "cuda_graph_max_batch": 0}
    eager = make_engine(path, **config)
    assert eager.runner.graphs is None
    expected, eager_logits, decodes = run(eager, prompts)
    padded = make_engine(path, **config)
    runner = padded.runner
    runner.use_decode_graphs(padded.pool, 8, capture=DEVICE == "cuda")
    got, padded_logits, _ = run(padded, prompts)
    reference = hf_reference(path)
    assert got == expected == [reference.greedy(p, n) for p, n in zip(prompts, MAX_TOKENS)]
    # Every batch of decodes went through the buffers (the prefill did not), padded or not.
    assert decodes == [5, 5, 4, 3, 3, 2, 2, 2] and runner.graphs.replays == len(decodes)
    assert padded.stats()["decode_graph_steps"] == runner.graphs.replays
    assert len(padded_logits) == len(eager_logits)
    for a, b in zip(eager_logits, padded_logits):
        assert a.shape == b.shape
        if a.numel():  # fp32: the split counts differ, so the sums' order, and nothing else
            assert (a - b).abs().max() / a.abs().max() < 1e-5
    # Padding rows wrote no KV: the same slots were written, with the same values (in the
    # window pool too, where the model has sliding layers).
    pools = [(eager.pool, padded.pool)] + (
        [(eager.pool.window, padded.pool.window)] if eager.pool.window else []
    )
    for one, other in pools:
        for side in ("k_cache", "v_cache"):
            a, b = getattr(one, side), getattr(other, side)
            if not a.numel():
                continue
            assert torch.equal(a.abs().sum((-2, -1)) == 0, b.abs().sum((-2, -1)) == 0)
            assert (a - b).abs().max() / a.abs().max() < 1e-5


def test_only_plain_decode_batches_fit_the_buffers(qwen2_gqa_model, make_engine):
    engine = make_engine(qwen2_gqa_model, attention_backend="triton", device=DEVICE, page_size=16)
    runner = engine.runner
    graphs = DecodeGraphs(runner.model, runner.backend, engine.pool, 4, 1024, capture=False)

    def batch(q_lens, prefix_lens, width=2, groups=()):
        slots = torch.zeros(sum(q_lens), dtype=torch.long)
        table = torch.zeros((len(q_lens), width), dtype=torch.int32)
        return AttentionBatch(list(q_lens), list(prefix_lens), slots, table, 16, list(groups))

    assert graphs.accepts(batch([1, 1, 1], [20, 5, 30]))
    assert not graphs.accepts(batch([1, 3], [20, 5]))  # a prefill chunk rides along
    assert not graphs.accepts(batch([1] * 5, [20] * 5))  # more than the largest bucket
    assert not graphs.accepts(batch([1, 1], [20, 20], groups=[([0, 1], 16)]))  # a cascade group
    assert not graphs.accepts(batch([1], [1024]))  # past the longest context captured
    assert not graphs.accepts(batch([1], [20], width=65))  # a page table wider than the buffer's


ON_THE_CPU = pytest.mark.skipif(
    torch.cuda.is_available(), reason="Triton runs on the GPU here, not in the interpreter on the CPU"
)


@ON_THE_CPU
def test_the_graph_setting_is_checked_and_off_on_the_cpu(qwen2_gqa_model, make_engine):
    from preble_backend.engine.config import EngineConfig

    with pytest.raises(ValueError, match="cuda_graph_max_batch=-1 is invalid"):
        EngineConfig(model_path=qwen2_gqa_model, cuda_graph_max_batch=-1)
    config = EngineConfig(model_path=qwen2_gqa_model, cuda_graph_max_batch=64, max_running_requests=16)
    assert config.graph_batch() == 16
    engine = make_engine(qwen2_gqa_model, attention_backend="triton", device="cpu")
    assert engine.runner.graphs is None and "decode_graph_steps" not in engine.stats()


@ON_THE_CPU
def test_the_graph_benchmark_runs_and_both_modes_give_the_same_tokens(capsys, tmp_path):
    """The GPU benchmark's code paths on tiny shapes: here the graph side is the buffers run
    eagerly, and every request's tokens equal the eager engine's."""
    import json

    from preble_backend.benchmarks.decode_graphs import main

    assert main(["--smoke", "--json", str(tmp_path / "graphs.json")]) == 0
    table = capsys.readouterr().out.split("| dtype |")[1]
    assert "| float32 | 1 |" in table and "| float32 | 3 |" in table
    record = json.loads((tmp_path / "graphs.json").read_text())
    assert record["float32/1"]["same_tokens"] == 1 and record["float32/3"]["same_tokens"] == 3
    assert record["float32/replays"] > 0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA device")
def test_captured_graphs_replay_on_the_gpu(qwen2_gqa_model, make_engine):
    """The engine's own capture at load (the default setting): replays serve the decode
    steps and the tokens are the eager engine's."""
    prompts = random_prompts(LENGTHS, 384, seed=5)
    eager = make_engine(qwen2_gqa_model, attention_backend="triton", device="cuda", cuda_graph_max_batch=0)
    captured = make_engine(qwen2_gqa_model, attention_backend="triton", device="cuda")
    assert sorted(captured.runner.graphs.graphs) == batch_buckets(64)
    assert run(captured, prompts)[0] == run(eager, prompts)[0]
    assert captured.runner.graphs.replays >= 8


def test_a_capture_that_fails_leaves_the_engine_eager_and_says_so(qwen2_gqa_model, make_engine, monkeypatch,
                                                                   caplog):  # fmt: skip
    """The capture path of ``make_pool`` (forced here: on the CPU nothing is captured):
    when capturing raises, the pool is still made, decode runs eagerly, and the log names
    the failure and the setting that skips it."""
    engine = make_engine(qwen2_gqa_model, attention_backend="triton", device=DEVICE, cuda_graph_max_batch=0)
    runner = engine.runner

    def fail(self):
        raise RuntimeError("operation not permitted when stream is capturing")

    monkeypatch.setattr(DecodeGraphs, "_capture", fail)
    runner.graph_batch = 4
    with caplog.at_level("ERROR", logger="preble.engine"):
        pool = runner.make_pool(8, 16)
    assert pool.num_pages == 8 and runner.graphs is None
    assert "capturing its CUDA graphs failed (RuntimeError: operation not permitted" in caplog.text
    assert "cuda_graph_max_batch = 0" in caplog.text
    params = {"max_tokens": 3, "temperature": 0.0, "ignore_eos": True}
    assert engine.generate(random_prompts([9], 384, seed=8), params)[0]  # the engine still serves
