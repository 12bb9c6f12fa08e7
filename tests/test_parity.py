"""Greedy output is token-identical to transformers' ``generate`` on the same checkpoint,
under every way the engine can split, share, evict and recompute the work."""

from __future__ import annotations

import pytest
from conftest import random_prompts

from preble_backend.model.model_config import ModelConfig

GREEDY = {"temperature": 0}


def vocab(model_path: str) -> int:
    return ModelConfig.from_dir(model_path).vocab_size


def expected(hf_reference, model_path, prompts, max_tokens):
    ref = hf_reference(model_path)
    return [ref.greedy(p, max_tokens) for p in prompts]


def test_one_request(any_model, make_engine, hf_reference):
    engine = make_engine(any_model, page_size=16)
    [prompt] = random_prompts([37], vocab(any_model), seed=1)
    out = engine.generate([prompt], {**GREEDY, "max_tokens": 24})
    assert out == expected(hf_reference, any_model, [prompt], 24)
    assert engine.stats()["prompt_tokens_computed"] == 37


def test_output_depends_on_distant_context(tiny_model, hf_reference):
    """Guard for the parity tests: the tiny model's continuation changes when only the
    first token changes, so matching outputs exercise attention over the whole prefix."""
    [a] = random_prompts([64], vocab(tiny_model), seed=2)
    b = [a[0] + 1] + a[1:]
    ref = hf_reference(tiny_model)
    assert ref.greedy(a, 8) != ref.greedy(b, 8)


@pytest.mark.parametrize("chunk_size", [16, 64])
def test_eight_concurrent_mixed_lengths(any_model, make_engine, hf_reference, chunk_size):
    engine = make_engine(any_model, page_size=8, chunk_size=chunk_size)
    prompts = random_prompts([3, 150, 17, 64, 1, 99, 33, 8], vocab(any_model), seed=3)
    out = engine.generate(prompts, {**GREEDY, "max_tokens": 12})
    assert out == expected(hf_reference, any_model, prompts, 12)


@pytest.mark.parametrize("chunk_size", [16, 64])
def test_shared_long_prefix_hits_cache(any_model, make_engine, hf_reference, chunk_size):
    engine = make_engine(any_model, page_size=16, chunk_size=chunk_size)
    [prefix] = random_prompts([300], vocab(any_model), seed=4)
    suffixes = random_prompts([5, 20, 1, 40], vocab(any_model), seed=5)
    prompts = [prefix + s for s in suffixes]
    first = engine.generate(prompts[:1], {**GREEDY, "max_tokens": 10})
    rest = engine.generate(prompts[1:], {**GREEDY, "max_tokens": 10})
    assert first + rest == expected(hf_reference, any_model, prompts, 10)
    stats = engine.stats()
    # The second wave reuses every full page of the shared prefix: 300 // 16 pages each.
    assert stats["prompt_tokens_cached"] == 3 * (300 // 16) * 16
    assert stats["prompt_tokens_computed"] == sum(len(p) for p in prompts) - stats["prompt_tokens_cached"]


def test_concurrent_requests_share_a_prefix_computed_in_the_same_run(tiny_model, make_engine, hf_reference):
    """Requests admitted after the first one's prefill hit the pages it just computed."""
    engine = make_engine(tiny_model, page_size=16, chunk_size=64, max_running_requests=1)
    [prefix] = random_prompts([200], vocab(tiny_model), seed=6)
    prompts = [prefix + s for s in random_prompts([4, 9, 13], vocab(tiny_model), seed=7)]
    out = engine.generate(prompts, {**GREEDY, "max_tokens": 6})
    assert out == expected(hf_reference, tiny_model, prompts, 6)
    assert engine.stats()["prompt_tokens_cached"] == 2 * (200 // 16) * 16


def test_small_pool_forces_eviction_and_preemption(any_model, make_engine, hf_reference):
    # 12 pages of 8 tokens: each request fits alone, eight at once cannot.
    engine = make_engine(any_model, page_size=8, chunk_size=64, max_num_tokens=96)
    start = engine.cache_events(None)  # an empty snapshot and the log's first cursor
    [prefix] = random_prompts([24], vocab(any_model), seed=8)
    prompts = [prefix + s for s in random_prompts([10, 30, 5, 41, 19, 2, 27, 12], vocab(any_model), seed=9)]
    out = engine.generate(prompts, {**GREEDY, "max_tokens": 20})
    assert out == expected(hf_reference, any_model, prompts, 20)
    stats = engine.stats()
    assert stats["num_preemptions"] > 0
    assert any(e.kind == "evicted" for e in engine.cache_events(start.cursor).events)


def test_prefix_caching_off_gives_same_tokens(tiny_model, make_engine):
    prompts = random_prompts([40, 40], vocab(tiny_model), seed=10)
    prompts[1][:32] = prompts[0][:32]
    on = make_engine(tiny_model, page_size=8).generate(prompts, {**GREEDY, "max_tokens": 8})
    off_engine = make_engine(tiny_model, page_size=8, enable_prefix_caching=False)
    assert off_engine.generate(prompts, {**GREEDY, "max_tokens": 8}) == on
    assert off_engine.stats()["prompt_tokens_cached"] == 0


@pytest.mark.parametrize(
    "penalties",
    [
        {"repetition_penalty": 1.5},
        {"repetition_penalty": 0.7},
        {"frequency_penalty": 1.2},
        {"presence_penalty": 1.5, "frequency_penalty": -0.3},
        {"repetition_penalty": 1.3, "frequency_penalty": 0.5, "presence_penalty": 0.4},
    ],
    ids=str,
)
def test_penalties_match_a_reference_loop_over_transformers(tiny_model, make_engine, hf_reference, penalties):
    """Penalties per request in a batch, against a greedy loop over transformers' logits:
    repetition through transformers' own ``RepetitionPenaltyLogitsProcessor`` (prompt and
    output tokens), frequency and presence by vLLM's definition (transformers has none)."""
    import torch
    from transformers import RepetitionPenaltyLogitsProcessor

    model = hf_reference(tiny_model).model
    prompts = [p * 3 for p in random_prompts([6, 9, 5, 7], vocab(tiny_model), seed=21)]  # repetitive
    n = 24

    @torch.inference_mode()
    def reference(prompt: list[int]) -> list[int]:
        ids, out = list(prompt), []
        for _ in range(n):
            scores = model(torch.tensor([ids])).logits[:, -1].float()
            if "repetition_penalty" in penalties:
                scores = RepetitionPenaltyLogitsProcessor(penalties["repetition_penalty"])(
                    torch.tensor([ids]), scores
                )
            if out:
                tokens, counts = torch.unique(torch.tensor(out), return_counts=True)
                scores[0, tokens] -= penalties.get("frequency_penalty", 0) * counts
                scores[0, tokens] -= penalties.get("presence_penalty", 0)
            out.append(int(scores[0].argmax()))
            ids.append(out[-1])
        return out

    engine = make_engine(tiny_model)
    params = {**GREEDY, "max_tokens": n, "ignore_eos": True}
    plain = engine.generate(prompts, params)
    penalized = engine.generate(prompts, {**params, **penalties})
    assert penalized == [reference(p) for p in prompts]
    assert penalized != plain  # the penalties changed what was generated


def test_logprobs_are_the_models_own(tiny_model, make_engine, hf_reference):
    """The sampled token's log probability and rank, and the top alternatives, come from
    the model's distribution before penalties and temperature, as transformers gives it."""
    import torch

    model = hf_reference(tiny_model).model
    [prompt] = random_prompts([30], vocab(tiny_model), seed=22)
    engine = make_engine(tiny_model)
    outputs = []
    params = {"temperature": 0.8, "seed": 5, "max_tokens": 6, "ignore_eos": True, "logprobs": 3,
              "repetition_penalty": 1.2}  # fmt: skip
    engine.add_request("lp", prompt, params, outputs.append)
    while engine.has_work():
        engine.step()
    tokens = [t for o in outputs for t in o.token_ids]
    steps = [step for o in outputs for step in o.logprobs]
    assert len(steps) == len(tokens) == 6
    with torch.inference_mode():
        logits = model(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1 : -1].float()
    reference = torch.log_softmax(logits, dim=-1)
    for token, step, ref in zip(tokens, steps, reference):
        assert next(iter(step)) == token  # the sampled token first
        logprob, rank = step[token]
        assert logprob == pytest.approx(float(ref[token]), abs=1e-4)
        assert rank == int((ref > ref[token]).sum()) + 1
        top = torch.topk(ref, 3).indices.tolist()
        assert set(top) <= set(step) and [step[t][1] for t in top] == [1, 2, 3]
