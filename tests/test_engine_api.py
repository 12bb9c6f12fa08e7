"""The engine's request API: validation, sampling and stopping, abort, the runner thread."""

from __future__ import annotations

import threading

import pytest
import torch
from conftest import random_prompts

from preble_backend.common.sampling_params import SamplingParams
from preble_backend.engine.config import EngineConfig
from preble_backend.engine.engine import Engine
from preble_backend.engine.outputs.sampling import SamplerState, sample
from preble_backend.engine.scheduling.local_scheduler import ScheduledBatch

GREEDY = {"temperature": 0}


@pytest.fixture
def engine(tiny_model, make_engine):
    return make_engine(tiny_model, page_size=8, chunk_size=32, max_num_tokens=1024)


@pytest.mark.parametrize(
    "prompt, params, message",
    [
        ([], {}, "prompt is empty"),
        ([5] * 4090, {"max_tokens": 16}, "over the model's context length of 4096"),
        ([5, 2048], {}, "token id 2048 is outside the vocabulary [0, 2048)"),
        ([5, -1], {}, "token id -1 is outside the vocabulary"),
        ([5], {"max_tokens": 0}, "max_tokens must be >= 1"),
        ([5], {"max_tokens": -1}, "max_tokens must be >= 1"),
        ([5], {"temperature": -0.5}, "temperature must be a finite number >= 0"),
        ([5], {"top_p": 0}, "top_p must be in (0, 1]"),
        ([5], {"top_p": 1.5}, "top_p must be in (0, 1]"),
        ([5], {"top_k": 0}, "top_k must be -1 (off) or >= 1"),
        ([5], {"beam_width": 2}, "unknown sampling parameter(s): beam_width"),
        ([5], {"max_tokens": "eight"}, "max_tokens must be an integer"),
        ([5], {"max_tokens": "1.5"}, "max_tokens must be an integer"),
        ([5], {"ignore_eos": "yes"}, "ignore_eos must be a boolean"),
        ([5], {"presence_penalty": 2.5}, "presence_penalty must be in [-2, 2]"),
        ([5], {"repetition_penalty": 0}, "repetition_penalty must be a finite number > 0"),
        ([5], {"logprobs": 21}, "logprobs must be in [0, 20]"),
        ([5], {"temperature": "hot"}, "temperature must be a number"),
        ([5], {"min_tokens": 9, "max_tokens": 4}, "min_tokens must be in [0, max_tokens=4]"),
        ([5], {"stop": [""]}, "stop strings must be non-empty"),
        ([5] * 1020, {"max_tokens": 8}, "exceeds the KV pool (1024 tokens)"),
    ],
)
def test_bad_input_is_named_and_the_engine_keeps_serving(
    engine, hf_reference, tiny_model, prompt, params, message
):
    [good] = random_prompts([20], 2048, seed=20)
    engine.add_request("good", good, {**GREEDY, "max_tokens": 6})
    with pytest.raises(ValueError) as err:
        engine.add_request("bad", prompt, params)
    assert message in str(err.value)
    outputs = []
    engine.add_request("after", good, {**GREEDY, "max_tokens": 6}, outputs.append)
    while engine.has_work():
        engine.step()
    assert [t for o in outputs for t in o.token_ids] == hf_reference(tiny_model).greedy(good, 6)


def test_duplicate_request_id_is_refused(engine):
    engine.add_request("same", [5, 6], {"max_tokens": 2})
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request("same", [5, 6], {"max_tokens": 2})
    while engine.has_work():
        engine.step()


def test_sampling_parameters_json():
    assert SamplingParams.from_json('{"max_tokens": 3, "stop": "x"}') == SamplingParams(
        max_tokens=3, stop=("x",)
    )
    assert SamplingParams.from_json("") == SamplingParams()
    with pytest.raises(ValueError, match="not valid JSON"):
        SamplingParams.from_json("{max_tokens: 3")
    with pytest.raises(ValueError, match="must be a JSON object"):
        SamplingParams.from_json("[1, 2]")


def test_seeded_sampling_is_reproducible_and_batch_independent(engine):
    prompts = random_prompts([12, 30], 2048, seed=21)
    params = {"temperature": 0.9, "top_p": 0.95, "top_k": 50, "seed": 7, "max_tokens": 12}
    alone = engine.generate(prompts[:1], params)
    together = engine.generate(prompts, params)
    assert together[0] == alone[0]
    assert engine.generate(prompts[:1], {**params, "seed": 8}) != alone


def test_top_k_one_and_tiny_top_p_are_greedy():
    logits = torch.randn(3, 100, generator=torch.Generator().manual_seed(0))
    greedy = logits.argmax(-1).tolist()
    for params in (SamplingParams(top_k=1), SamplingParams(top_p=1e-6, seed=1)):
        states = [SamplerState.create(params, "cpu") for _ in range(3)]
        assert sample(logits, states, [[], [], []]) == greedy


def test_banned_tokens_are_never_sampled():
    logits = torch.zeros(1, 5)
    logits[0, 3] = 100.0
    state = SamplerState.create(SamplingParams(temperature=0), "cpu")
    assert sample(logits, [state], [[3]]) != [3]


def test_stop_token_ids_min_tokens_and_ignore_eos(engine, hf_reference, tiny_model):
    [prompt] = random_prompts([25], 2048, seed=22)
    ref = hf_reference(tiny_model).greedy(prompt, 10)
    stop_at = ref[4]
    first = ref.index(stop_at)
    out = engine.generate([prompt], {**GREEDY, "max_tokens": 10, "stop_token_ids": [stop_at]})
    assert out == [ref[: first + 1]]
    # min_tokens forbids the stop token until that many tokens exist: the output diverges.
    late = engine.generate(
        [prompt], {**GREEDY, "max_tokens": 10, "min_tokens": 8, "stop_token_ids": [stop_at]}
    )
    assert len(late[0]) >= 8 and stop_at not in late[0][:8]


def test_stop_strings_end_generation(engine, tiny_model):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model)
    [prompt] = random_prompts([25], 2048, seed=23)
    [full] = engine.generate([prompt], {**GREEDY, "max_tokens": 12})
    text = tok.decode(full)
    stop = text[len(text) // 2 : len(text) // 2 + 2]
    outputs = []
    engine.add_request("s", prompt, {**GREEDY, "max_tokens": 12, "stop": [stop]}, outputs.append)
    while engine.has_work():
        engine.step()
    got = [t for o in outputs for t in o.token_ids]
    assert outputs[-1].finish_reason == "stop"
    assert stop in tok.decode(got) and stop not in tok.decode(got[:-1])
    assert full[: len(got)] == got


def test_a_stop_string_completed_before_min_tokens_is_passed_over(engine, tiny_model):
    """vLLM's semantics: stop strings are checked from the ``min_tokens``-th token on, and
    only in the text each new token adds; an occurrence completed earlier does not stop
    the request later, the next one does (the old check stopped at exactly min_tokens)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model)
    [prompt] = random_prompts([25], 2048, seed=23)
    [full] = engine.generate([prompt], {**GREEDY, "max_tokens": 40, "ignore_eos": True})

    def completed(stop: str, times: int) -> int | None:
        """How many tokens it takes for ``stop`` to occur ``times`` times."""
        return next((k for k in range(1, len(full) + 1) if tok.decode(full[:k]).count(stop) >= times), None)

    cases = [(c, completed(c, 1), completed(c, 2)) for c in sorted(set(tok.decode(full))) if c.strip()]
    stop, first, second = next((c, a, b) for c, a, b in cases if b is not None and b > a + 1)
    outputs = []
    params = {**GREEDY, "max_tokens": 40, "ignore_eos": True, "stop": [stop], "min_tokens": first + 1}
    engine.add_request("s", prompt, params, outputs.append)
    while engine.has_work():
        engine.step()
    got = [t for o in outputs for t in o.token_ids]
    assert (len(got), outputs[-1].finish_reason) == (second, "stop")
    assert got == full[:second]


def test_finish_reasons_and_counts_stream_to_the_callback(engine):
    [prompt] = random_prompts([10], 2048, seed=24)
    outputs = []
    engine.add_request("r", prompt, {**GREEDY, "max_tokens": 5, "ignore_eos": True}, outputs.append)
    while engine.has_work():
        engine.step()
    assert [len(o.token_ids) for o in outputs] == [1] * 5
    assert [o.finished for o in outputs] == [False] * 4 + [True]
    last = outputs[-1]
    assert (last.finish_reason, last.num_prompt_tokens, last.num_output_tokens) == ("length", 10, 5)
    # the engine's time to first token rides the output that carries that token, and no other
    assert outputs[0].first_token_s > 0 and [o.first_token_s for o in outputs[1:]] == [None] * 4


def test_abort_frees_pages_midway(engine):
    prompts = random_prompts([100, 40], 2048, seed=25)
    outputs = []
    engine.add_request("a", prompts[0], {**GREEDY, "max_tokens": 50}, outputs.append)
    engine.add_request("b", prompts[1], {**GREEDY, "max_tokens": 3})
    for _ in range(6):
        engine.step()
    engine.abort("a")
    engine.abort("no-such-request")  # ignored
    while engine.has_work():
        engine.step()
    assert outputs[-1].finish_reason == "abort" and outputs[-1].finished
    assert engine.stats()["running"] == 0  # teardown checks every page came back


def test_runner_thread_serves_many_client_threads(tiny_model, make_engine, hf_reference):
    engine = make_engine(tiny_model, page_size=8, chunk_size=48)
    prompts = random_prompts([9, 31, 57, 4, 22, 80], 2048, seed=26)
    engine.start()
    results: dict[int, list[int]] = {}
    done = threading.Event()

    def submit(i: int) -> None:
        def on_output(out):
            results.setdefault(i, []).extend(out.token_ids)
            if out.finished and len(results) == len(prompts) and all(len(v) == 8 for v in results.values()):
                done.set()

        engine.add_request(f"t{i}", prompts[i], {**GREEDY, "max_tokens": 8, "ignore_eos": True}, on_output)

    threads = [threading.Thread(target=submit, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert done.wait(60)
    engine.shutdown()
    ref = hf_reference(tiny_model)
    assert [results[i] for i in range(len(prompts))] == [ref.greedy(p, 8) for p in prompts]


def test_engine_config_names_the_bad_key(tiny_model):
    with pytest.raises(ValueError, match="page_size=12"):
        EngineConfig(model_path=tiny_model, page_size=12)
    with pytest.raises(ValueError, match="chunk_size='big' is invalid"):
        EngineConfig.from_strings({"model_path": tiny_model, "chunk_size": "big"})
    with pytest.raises(ValueError, match="unknown engine parameter"):
        EngineConfig.from_strings({"model_path": tiny_model, "chunk": "1"})
    cfg = EngineConfig.from_strings({"model_path": tiny_model, "enable_prefix_caching": "false"})
    assert cfg.enable_prefix_caching is False


def test_emulated_compute_waits_the_cost_model_and_keeps_the_real_cache(tiny_model, make_engine, tmp_path):
    """compute=emulated: the real scheduler and radix cache, no weights; each iteration
    waits the cost model's time (here base 10 ms + 1 ms per prefill token + 0.5 ms per
    decode) and every request gets the placeholder token."""
    from preble_backend.common.cost_model import CostModel

    fit = tmp_path / "unit.json"
    CostModel(base_ms=10, prefill_ms_per_token=1, decode_ms_per_request=0.5,
              attention_ms_per_context_token=0, decode_step_ms=10).save(fit)  # fmt: skip
    engine = make_engine(tiny_model, compute="emulated", cost_model=str(fit), page_size=16,
                         chunk_size=512, max_num_tokens=4096)  # fmt: skip
    runner = engine.runner
    prompt = list(range(100, 140))
    # 40-token prefill with the first token (50 ms), then two decodes (10.5 ms each).
    assert engine.generate([prompt], {"max_tokens": 3}) == [[runner.placeholder] * 3]
    assert runner.iterations == 3 and runner.emulated_s == pytest.approx(0.071)
    # The cache is real: a prompt sharing the first 32 tokens (two pages) prefills 8.
    engine.generate([prompt[:32] + list(range(500, 508))], {"max_tokens": 1, "temperature": 0.8})
    assert runner.emulated_s == pytest.approx(0.071 + 0.018)
    assert engine.stats()["prompt_tokens_cached"] == 32
    assert runner.placeholder not in engine.model_config.eos_token_ids
    # The modelled device runs iterations back to back: host work between two overlaps
    # the next (a 6 ms pause inside a 10 ms iteration costs nothing); host work longer
    # than an iteration shows, as emulated_behind_s; after the engine idles nothing
    # overlaps. An empty batch costs the base time alone: 10 ms. On a fake clock.
    now = [0.0]
    runner.clock = lambda: now[0]
    runner.sleep = lambda s: now.__setitem__(0, now[0] + s)
    empty = ScheduledBatch([], [])

    def timed(pause: float) -> float:
        runner.went_idle()
        start = now[0]
        runner.forward(empty, engine.pool)
        now[0] += pause  # the host's work between the two iterations
        runner.forward(empty, engine.pool)
        return now[0] - start

    behind = runner.behind_s  # what the real iterations above ran behind: the host's speed
    assert timed(0.006) == pytest.approx(0.020) and runner.behind_s == pytest.approx(behind)
    assert timed(0.030) == pytest.approx(0.040) and runner.behind_s == pytest.approx(behind + 0.02)
    # emulated_slowdown plays the same GPU k times slower.
    slow = make_engine(tiny_model, compute="emulated", cost_model=str(fit), page_size=16, chunk_size=512,
                       max_num_tokens=4096, emulated_slowdown=2.5)  # fmt: skip
    slow.generate([prompt], {"max_tokens": 3})
    assert slow.runner.emulated_s == pytest.approx(2.5 * 0.071)


def test_emulated_compute_names_a_bad_cost_model(tiny_model):
    with pytest.raises(ValueError, match="cost_model='nosuch' is invalid"):
        EngineConfig(model_path=tiny_model, compute="emulated", cost_model="nosuch")
    with pytest.raises(ValueError, match="compute='gpu' is invalid: expected one of model, emulated"):
        EngineConfig(model_path=tiny_model, compute="gpu")


def test_a_cpu_engine_runs_on_its_own_cores(tiny_model):
    """cpu_cores pins every thread of the process and sizes torch's pool; run in a child
    process, since pinning is process-wide."""
    import subprocess
    import sys

    code = (
        "import os, torch\n"
        "from preble_backend.engine.config import EngineConfig\n"
        "from preble_backend.engine.engine import Engine\n"
        f"e = Engine(EngineConfig(model_path={tiny_model!r}, cpu_cores='0', max_num_tokens=1024))\n"
        "e.generate([[5, 6, 7]], {'max_tokens': 2})\n"
        "tasks = os.listdir('/proc/self/task')\n"
        "print(sorted(os.sched_getaffinity(0)), torch.get_num_threads(),"
        " all(os.sched_getaffinity(int(t)) == {0} for t in tasks))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.stdout.split("\n")[-2] == "[0] 1 True", out.stderr[-2000:]
    with pytest.raises(ValueError, match=r"cpu_cores='4096' is invalid: core\(s\) \[4096\] are not"):
        Engine(EngineConfig(model_path=tiny_model, cpu_cores="4096"))
    with pytest.raises(ValueError, match="cpu_cores='x-1' is invalid: expected cores like 0-1,4"):
        EngineConfig(model_path=tiny_model, cpu_cores="x-1")
