"""The CPU attention path (``sdpa``: decode queries batched into one SDPA call) against the
kernels' torch reference, and the engine on it against the engine on the reference."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from conftest import random_prompts
from test_kernels import paged_batch

from kernels import reference as ref
from preble_backend.model.attention import AttentionBatch
from preble_backend.model.attention_sdpa import SdpaAttention


@pytest.mark.parametrize("group", [1, 3, 4])
@pytest.mark.parametrize("page_size", [1, 16])
def test_sdpa_equals_the_reference_on_a_mixed_batch(group, page_size):
    """Decode rows of very different lengths beside chunks with and without a prefix."""
    q_lens, prefix_lens = [1, 7, 1, 1, 12, 1, 5], [33, 0, 5, 90, 19, 0, 16]
    q, k, v, table = paged_batch(q_lens, prefix_lens, 4 * group, 4, 64, page_size, seed=group)
    batch = AttentionBatch(q_lens, prefix_lens, torch.full((sum(q_lens),), -1), table, page_size, [])
    pool = SimpleNamespace(k_cache=[k], v_cache=[v])  # every position already written (no new slots)
    new = torch.zeros((sum(q_lens), 4, 64), dtype=q.dtype)  # slot -1: nothing is written
    out = SdpaAttention().forward(0, q, new, new, batch, pool)
    expect, _ = ref.extend_attention_ref(q, k, v, table, q_lens, prefix_lens, page_size, with_lse=False)
    assert torch.allclose(out, expect, rtol=1e-10, atol=1e-10)
    two_layers = SimpleNamespace(k_cache=[k, k], v_cache=[v, v])
    assert torch.equal(SdpaAttention().forward(1, q, new, new, batch, two_layers), out)  # plan reused


def test_the_engine_on_sdpa_answers_as_on_the_reference(any_model, make_engine):
    prompts = random_prompts([5, 40, 17, 64, 3, 29, 8, 50], 320, seed=9)
    params = {"temperature": 0, "max_tokens": 12, "ignore_eos": True}
    reference = make_engine(any_model, attention_backend="torch", chunk_size=32).generate(prompts, params)
    batched = make_engine(any_model, attention_backend="sdpa", chunk_size=32).generate(prompts, params)
    assert batched == reference
