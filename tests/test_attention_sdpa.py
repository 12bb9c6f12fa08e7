"""The CPU attention path (``sdpa``: decode queries batched into one SDPA call per group of
like context lengths) against the kernels' torch reference, and the engine on it against the
engine on the reference."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from conftest import random_prompts
from test_kernels import paged_batch

from kernels import reference as ref
from preble_backend.model.attention import AttentionBatch
from preble_backend.model.attention_sdpa import SdpaAttention, decode_groups


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


def test_decode_requests_of_unlike_lengths_attend_in_groups():
    """Shortest first; a group takes a length within twice its shortest, or 256 tokens of
    it: seven 250-token contexts and one of 1,750 are two calls, not eight padded to 1,750."""
    assert decode_groups([250] * 7 + [1750]) == [list(range(7)), [7]]
    assert decode_groups([100, 5000, 300, 260]) == [[0, 3, 2], [1]]
    assert decode_groups([1000, 1900, 2100]) == [[0, 1], [2]]
    assert decode_groups([]) == []


@pytest.mark.parametrize("window", [None, 128])
def test_decode_groups_attend_as_the_reference(window):
    """Decode rows in three groups (21; 301 and 601; 701 and 1,401 positions) beside a
    chunk, with and without a sliding window: each group's own padding and window mask."""
    q_lens, prefix_lens = [1, 1, 1, 1, 1, 9], [20, 600, 300, 1400, 700, 40]
    assert len(decode_groups([p + 1 for p in prefix_lens[:5]])) == 3
    q, k, v, table = paged_batch(q_lens, prefix_lens, 8, 4, 32, 16, seed=3)
    batch = AttentionBatch(q_lens, prefix_lens, torch.full((sum(q_lens),), -1), table, 16, [])
    pool = SimpleNamespace(k_cache=[k], v_cache=[v])
    new = torch.zeros((sum(q_lens), 4, 32), dtype=q.dtype)
    out = SdpaAttention().forward(0, q, new, new, batch, pool, window=window)
    expect, _ = ref.extend_attention_ref(q, k, v, table, q_lens, prefix_lens, 16, with_lse=False,
                                         window=window)  # fmt: skip
    assert torch.allclose(out, expect, rtol=1e-10, atol=1e-10)


def test_the_engine_on_sdpa_answers_as_on_the_reference(any_model, make_engine):
    prompts = random_prompts([5, 40, 17, 64, 3, 29, 8, 50], 320, seed=9)
    params = {"temperature": 0, "max_tokens": 12, "ignore_eos": True}
    reference = make_engine(any_model, attention_backend="torch", chunk_size=32).generate(prompts, params)
    batched = make_engine(any_model, attention_backend="sdpa", chunk_size=32).generate(prompts, params)
    assert batched == reference
