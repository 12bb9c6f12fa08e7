"""Tensor parallelism on CPU with gloo (``model/tensor_parallel.py``, ``engine/runners/tp_ranks.py``):
an engine split over 2 or 4 ranks generates exactly what the same engine on one device
does, greedy and seeded, under chunked prefill, prefix sharing and preemption, on
checkpoints whose heads split differently (GQA with fewer KV heads than ranks, tied
embeddings, biases, Llama-3 rope); and a rank that dies fails its engine, not hangs it."""

from __future__ import annotations

from dataclasses import astuple

import pytest
import torch
from conftest import generate_aborting, random_prompts

from preble_backend.model.model_config import ModelConfig
from preble_backend.model.tensor_parallel import head_split

GREEDY = {"max_tokens": 10, "temperature": 0, "ignore_eos": True}
SEEDED = {"max_tokens": 10, "temperature": 0.8, "top_p": 0.9, "seed": 7, "ignore_eos": True}


def _prompts(vocab: int) -> list[list[int]]:
    shared = random_prompts([48], vocab, seed=1)[0]  # three prompts over one prefix, one apart
    tails = random_prompts([5, 17, 30, 61], vocab, seed=2)
    return [shared + tails[0], shared + tails[1], shared + tails[2], tails[3]]


def _run(make_engine, model: str, tp: int, params: dict, **config) -> tuple[list[list[int]], dict]:
    engine = make_engine(model, tensor_parallel_size=tp, chunk_size=16, **config)
    vocab = engine.model_config.vocab_size
    out = engine.generate(_prompts(vocab), params)
    return out, engine.stats()


MOE = ("qwen3_moe", "qwen3_moe_plain", "mixtral", "mixtral_fused", "gpt_oss")
NEW = ("qwen3", "gemma3", "qwen3_window", "mistral_window")


def checkpoint(request, name: str) -> str:
    if name in MOE:
        return request.getfixturevalue("moe_models")[name]
    return request.getfixturevalue("new_models")[name] if name in NEW else request.getfixturevalue(name)


@pytest.fixture(scope="session")
def moe_models(tmp_path_factory) -> dict[str, str]:
    """Mixtures: each expert's intermediate features split across the ranks, read from
    per-expert tensors (as transformers saves them) and from the fused layout."""
    from checkpoints import MODELS, fused_copy

    built = {
        name: MODELS[name](tmp_path_factory.mktemp(name))
        for name in ("qwen3_moe", "qwen3_moe_plain", "mixtral", "gpt_oss")
    }
    built["mixtral_fused"] = fused_copy(built["mixtral"], tmp_path_factory.mktemp("mixtral_fused"))
    return built


@pytest.fixture(scope="session")
def new_models(tmp_path_factory) -> dict[str, str]:
    """Qwen3 (per-head q/k norms), and models with sliding-window layers, whose sliding KV
    every rank keeps in a window pool of its own heads (windows of 16-24 tokens: the
    prompts run past them)."""
    from checkpoints import MODELS, WINDOWED

    built = {"qwen3": MODELS["qwen3"](tmp_path_factory.mktemp("qwen3"))}
    for name in ("gemma3", "qwen3_window", "mistral_window"):
        built[name] = WINDOWED[name](tmp_path_factory.mktemp(name))
    return built


@pytest.mark.parametrize(("model", "tp"), [("qwen2_gqa_model", 2), ("qwen2_gqa_model", 4),
                                           ("llama3_tied_model", 2), ("llama3_tied_model", 4),
                                           ("llama_bias_model", 2), ("qwen3_moe", 2), ("qwen3_moe_plain", 4),
                                           ("mixtral", 2), ("mixtral_fused", 2), ("qwen3", 2), ("gemma3", 2),
                                           ("qwen3_window", 2), ("mistral_window", 2),
                                           ("gpt_oss", 2)])  # fmt: skip
def test_tp_generates_exactly_what_one_device_does(request, make_engine, model, tp):
    path = checkpoint(request, model)
    for params in (GREEDY, SEEDED):
        one, _ = _run(make_engine, path, 1, params)
        split, stats = _run(make_engine, path, tp, params)
        assert split == one, (model, tp, params)
        assert stats["prompt_tokens_cached"] > 0  # the shared prefix was reused on every rank


def test_tp_with_sliding_windows_in_a_tight_window_pool(request, make_engine):
    """Each rank's window pool holds one window and a chunk twice over: windows go and are
    recomputed, identically on every rank."""
    path = checkpoint(request, "gemma3")
    tight = {"page_size": 8, "window_kv_tokens": 96}
    one, _ = _run(make_engine, path, 1, GREEDY, **tight)
    split, stats = _run(make_engine, path, 2, GREEDY, **tight)
    assert split == one and stats["kv_window_pages_total"] == 12


def test_tp_under_preemption(qwen2_gqa_model, make_engine):
    small = {"max_num_tokens": 160, "page_size": 16}  # four requests cannot all stay: preemption
    one, stats_one = _run(make_engine, qwen2_gqa_model, 1, {**GREEDY, "max_tokens": 24}, **small)
    split, stats = _run(make_engine, qwen2_gqa_model, 2, {**GREEDY, "max_tokens": 24}, **small)
    assert stats["num_preemptions"] > 0 and stats["num_preemptions"] == stats_one["num_preemptions"]
    assert split == one


def test_heads_split_and_kv_heads_replicate_where_fewer_than_ranks(qwen2_gqa_model):
    cfg = ModelConfig.from_dir(qwen2_gqa_model)  # 8 query heads, 2 KV heads
    assert [astuple(head_split(cfg, 2, r)) for r in range(2)] == [(0, 4, 0, 1), (4, 4, 1, 1)]
    four = [head_split(cfg, 4, r) for r in range(4)]  # each KV head on the two ranks that read it
    assert [(s.q_start, s.kv_start, s.kv_count) for s in four] == [(0, 0, 1), (2, 0, 1), (4, 1, 1), (6, 1, 1)]
    with pytest.raises(ValueError, match="tensor_parallel_size=3 is invalid: the model's 8 attention heads"):
        head_split(cfg, 3, 0)


def test_a_rank_that_dies_fails_its_engine_at_once_and_frees_its_pages(qwen2_gqa_model, make_engine):
    from preble_backend.engine.runners.tp_ranks import RankLost

    engine = make_engine(qwen2_gqa_model, tensor_parallel_size=2)
    assert engine.generate([[5, 6, 7, 8]], GREEDY)[0]
    follower = engine.runner.ranks.processes[0]
    follower.kill()
    follower.join()
    with pytest.raises(RankLost, match="tensor-parallel rank 1 exited"):
        engine.generate([[5, 6, 7, 9]], GREEDY)  # not a hang, not a request's error
    engine.shutdown()  # the request it held ends; every page comes back (the fixture checks)


def test_preble_repo_groups_gpus_into_tensor_parallel_engines(tmp_path, capsys):
    from preble_backend.cli import main
    from preble_backend.serving.pbtxt import config_parameter

    assert main(["repo", str(tmp_path / "r"), "--gpus", "0,1,2,3,4,5,6,7", "--tensor-parallel", "4"]) == 0
    engines = sorted(p.name for p in (tmp_path / "r").iterdir() if p.name.startswith("preble_engine"))
    assert engines == ["preble_engine_0", "preble_engine_1"]  # the paper's 70B setup: two TP-4 instances
    for name, device in zip(engines, ("cuda:0", "cuda:4")):
        text = (tmp_path / "r" / name / "config.pbtxt").read_text()
        assert "instance_group [ { count: 1 kind: KIND_MODEL } ]" in text  # one instance, its ranks its own
        assert config_parameter(text, "device") == device
        assert config_parameter(text, "tensor_parallel_size") == "4"
    router = (tmp_path / "r" / "preble" / "config.pbtxt").read_text()
    assert config_parameter(router, "engines") == "preble_engine_0,preble_engine_1"
    assert main(["repo", str(tmp_path / "bad"), "--gpus", "0,1,2", "--tensor-parallel", "2"]) != 0
    assert "gpus=[0, 1, 2] is invalid for tensor_parallel_size=2" in capsys.readouterr().err


@pytest.mark.server  # a real tritonserver
def test_a_tp2_engine_serves_behind_the_router_as_one_engine(tmp_path, tiny_model):
    """Two engines behind the router, one of them split over two ranks: pinned to either,
    a greedy request gets the same text; the router sees two engines. A rank killed: the
    request moves on with the same text and the engine comes back."""
    import json
    import os
    import re
    import signal

    from server_utils import http, serve_stack, wait_for, write_test_repository

    from preble_backend.common.procfs import command_line, process_tree
    from preble_backend.serving.pbtxt import set_config_parameter

    repo = write_test_repository(tmp_path / "repo", cpu_engines=2)
    config = repo / "preble_engine_1" / "config.pbtxt"
    config.write_text(set_config_parameter(config.read_text(), "tensor_parallel_size", "2"))
    stack = serve_stack(repo)
    try:
        sampling = json.dumps({"max_tokens": 16, "temperature": 0, "ignore_eos": True})
        for prompt in ("The weather in Paris", "A long shared prefix, then a question", "Hello"):
            texts = []
            for engine in ("preble_engine_0", "preble_engine_1"):
                body = json.dumps({"text_input": prompt, "sampling_parameters": sampling,
                                   "parameters": {"preble_engine": engine}}).encode()  # fmt: skip
                status, _, answer = http("POST", stack.url("/v2/models/preble/generate"), body)
                assert status == 200, answer
                texts.append(json.loads(answer)["text_output"])
            assert texts[0] == texts[1] and texts[0], (prompt, texts)
        _, _, metrics = http("GET", stack.url("/metrics", stack.ports.metrics))
        assert metrics.decode().count("preble_router_engine_up{") == 2
        # A rank dies: the engine's next pass fails, its stub exits, the request moves on
        # with the same text, and the supervisor brings the engine back.
        stub = stack.engine_stub("preble_engine_1")
        ranks = [p for p in process_tree(stub) if b"spawn_main" in b" ".join(command_line(p))]
        assert len(ranks) == 1, ranks  # rank 1; rank 0 is the stub itself
        os.kill(ranks[0], signal.SIGKILL)
        body = json.dumps({"text_input": "Hello", "sampling_parameters": sampling,
                           "parameters": {"preble_engine": "preble_engine_1"}}).encode()  # fmt: skip
        status, _, answer = http("POST", stack.url("/v2/models/preble/generate"), body, timeout=120)
        assert status == 200 and json.loads(answer)["text_output"] == texts[0], answer  # Hello's text

        def restarted() -> bool:
            try:
                if stack.engine_stub("preble_engine_1") == stub:
                    return False
            except LookupError:  # between its server's death and its restart
                return False
            text = http("GET", stack.url("/metrics", stack.ports.metrics))[2].decode()
            up = re.search(r'preble_router_engine_up\{[^}]*engine="preble_engine_1"[^}]*\} 1', text)
            return up is not None

        wait_for(restarted, 120, "the engine's restart")
    finally:
        out, err = stack.stop()
    assert stack.process.returncode == 0, err
    assert "engine preble_engine_1 is back (restart 1)" in out, out


@pytest.mark.parametrize("model", ["llama3_tied_model", "qwen3_moe"])
def test_one_all_reduce_per_attention_block_and_per_mlp_per_pass(request, make_engine, model):
    """Also for a mixture (one dense layer, one of experts): its experts' partial outputs
    are summed once, after all of them."""
    path = (
        request.getfixturevalue("moe_models")[model]
        if model == "qwen3_moe"
        else request.getfixturevalue(model)
    )
    engine = make_engine(path, tensor_parallel_size=2, chunk_size=16)
    group, runner = engine.runner.ranks.group, engine.runner
    counts = {"all_reduce": 0, "forward": 0}
    reduce, forward = group.all_reduce, runner.forward

    def counted_reduce(x):
        counts["all_reduce"] += 1
        return reduce(x)

    def counted_forward(batch, pool):
        counts["forward"] += 1
        return forward(batch, pool)

    group.all_reduce, runner.forward = counted_reduce, counted_forward
    engine.generate(_prompts(engine.model_config.vocab_size), GREEDY)  # batches of several requests
    layers = engine.model_config.num_layers
    assert counts["forward"] > 0 and counts["all_reduce"] == 2 * layers * counts["forward"]


@pytest.mark.parametrize(("device", "size", "message"), [
    ("cuda:0", 2, "tensor_parallel_size=2 is invalid on cuda:0: its ranks need GPUs 0 to 1"),
    ("cpu", 3, "tensor_parallel_size=3 is invalid: the model's 8 attention heads"),
])  # fmt: skip
def test_bad_tensor_parallel_configurations_are_refused_by_name(qwen2_gqa_model, device, size, message):
    import torch

    from preble_backend.engine.runners.model_runner import ModelRunner

    if device.startswith("cuda") and torch.cuda.device_count() >= 2:
        pytest.skip("this host has the GPUs")
    with pytest.raises(ValueError, match=message):
        ModelRunner(qwen2_gqa_model, "float32", device, "auto", size)


def test_tp_with_an_abort_mid_batch(llama3_tied_model, make_engine):
    """Rank 0 decides the abort; the other ranks only ever run the passes it sends, so the
    requests left finish exactly as on one device, and every page comes back."""

    def run(tp: int) -> dict[str, list[int]]:
        engine = make_engine(llama3_tied_model, tensor_parallel_size=tp, chunk_size=16)
        prompts = _prompts(engine.model_config.vocab_size)
        outputs = generate_aborting(engine, prompts, {**GREEDY, "max_tokens": 20}, "r1", 6)
        engine.shutdown()
        return outputs

    one, split = run(1), run(2)
    assert split == one and len(split["r1"]) < 20 and all(len(split[r]) == 20 for r in ("r0", "r2", "r3"))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_rank_reads_its_slices_without_a_memory_map(tmp_path, dtype):
    """Row and column slices read with pread equal safetensors' own slices, for 2-D
    weights, 1-D biases and stacked experts' [E, rows, cols] alike."""
    import os

    from safetensors import safe_open
    from safetensors.torch import save_file

    from preble_backend.model.safetensors_slices import read_header, read_slice

    gen = torch.Generator().manual_seed(0)
    tensors = {"w": torch.randn(12, 20, generator=gen), "b": torch.randn(12, generator=gen),
               "e": torch.randn(3, 8, 6, generator=gen)}  # fmt: skip
    tensors = {k: t.to(dtype) for k, t in tensors.items()}
    save_file(tensors, str(tmp_path / "m.safetensors"))
    data_start, header = read_header(tmp_path / "m.safetensors")
    fd = os.open(tmp_path / "m.safetensors", os.O_RDONLY)
    try:
        with safe_open(str(tmp_path / "m.safetensors"), framework="pt") as f:
            for key, dim, start, count in (("w", 0, 3, 6), ("w", 1, 5, 10), ("b", 0, 4, 8), ("w", 1, 0, 20),
                                           ("e", 1, 2, 4), ("e", 2, 3, 3), ("e", 0, 1, 2)):  # fmt: skip
                want = f.get_slice(key)[(slice(None),) * dim + (slice(start, start + count),)]
                got = read_slice(fd, data_start, header[key], dim, start, count)
                assert got.dtype == dtype and torch.equal(got, want), (key, dim)
    finally:
        os.close(fd)


def test_rank_0s_store_listens_before_any_follower_starts(monkeypatch):
    """A port found free and bound only later can be taken in between by another engine's
    gloo pairs (CI lost a TP-2 prefill + TP-2 decode server to it): the group's port must
    already be rank 0's when its followers start. No follower is spawned here, so rank 0's
    group times out waiting for it, at once."""
    import multiprocessing.context
    import socket

    from preble_backend.engine.runners.tp_ranks import Ranks

    listening = []

    def start(process) -> None:
        with socket.socket() as s:
            listening.append(s.connect_ex(("127.0.0.1", process._args[2])) == 0)

    monkeypatch.setattr(multiprocessing.context.SpawnProcess, "start", start)
    with pytest.raises(RuntimeError):
        Ranks(2, "cpu", print, (), timeout_s=1.0)
    assert listening == [True]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="NCCL needs a CUDA device")
def test_the_engines_nccl_group_forms_on_a_gpu():
    """What one lent GPU can check (two ranks on one GPU is not a configuration NCCL
    runs, so TP 2 against TP 1 stays a gloo claim): an engine's NCCL group forms, sums in
    place and carries rank 0's messages; the TP-1 engine on CUDA is the parity suite's."""
    from preble_backend.engine.runners.tp_ranks import Group, rendezvous_store

    group = Group(0, 1, rendezvous_store(1, 30.0), "cuda:0", timeout_s=30.0)
    x = torch.arange(6.0, device="cuda:0")
    assert group.all_reduce(x) is x and torch.equal(x, torch.arange(6.0, device="cuda:0"))
    group.send(("pool", 4, 16))  # a broadcast with no follower to receive it
