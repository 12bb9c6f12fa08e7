"""Sliding-window layers keep only their windows (``engine/cache/sliding_windows.py``): the
rule that says where a cached prefix can be resumed, the engine serving past the window
from a window pool that holds one request's window and chunk, token for token as
transformers; a prefix whose window is gone recomputed, and whole again after; the global
tree mirroring the same hits from the engine's events; and E2 charging the true recompute."""

from __future__ import annotations

from array import array

import pytest
from checkpoints import _gemma3
from conftest import random_prompts

from preble_backend.common.block_hash import chain_hashes
from preble_backend.common.cache_event import CacheEvent
from preble_backend.common.prefix import window_hit
from scheduler.e2 import E2
from scheduler.global_tree import GlobalPrefixTree

GREEDY = {"temperature": 0}


@pytest.mark.parametrize(
    ("held", "expected"),
    [
        # page size 4, window 6: resuming after page k reads the keys from 4k - 5 on, i.e.
        # pages k-2 and k-1 (page 0 alone for k = 1)
        ([True] * 5, 5),
        ([False, True, True, False, True, True], 6),
        ([True, True, True, True, False, True], 4),  # page 5 lacks page 4's window
        ([False, True, False, True, False], 0),  # no two held pages in a row
        ([True, False, False], 1),  # after page 0 only page 0 is read
        ([], 0),
    ],
)
def test_a_prefix_resumes_where_its_last_window_is_held(held, expected):
    assert window_hit(held, window=6, page_size=4) == expected


def test_a_window_that_fits_in_a_page_needs_one_page():
    # window 3, page 8: after page k the keys from 8k - 2 on: pages k-1 only (k >= 1)
    assert window_hit([False, True, False, True], window=3, page_size=8) == 4
    assert window_hit([True, False], window=3, page_size=8) == 1


@pytest.fixture(scope="module")
def gemma(tmp_path_factory) -> str:
    """Gemma-3-shaped: two sliding layers (window 16) to one full."""
    return _gemma3(tmp_path_factory.mktemp("gemma_windows"))


def mirrored(engine, tree: GlobalPrefixTree, cursor: str | None) -> str:
    batch = engine.cache_events(cursor)
    if batch.snapshot:
        tree.forget(0)
    tree.apply_events(0, batch.events)
    return batch.cursor


def test_the_window_pool_holds_one_window_and_a_chunk_and_hits_need_a_held_window(
    gemma, make_engine, hf_reference
):
    """Window pool of 5 pages of 8 tokens (the window, 16, and a chunk, 16, need 5): a
    200-token prompt is served token for token as transformers, never more than 5 window
    pages needed. A second prompt sharing its first 120 tokens finds the full layers' 15
    pages cached but their windows long gone (pages 13 and 14 are read after page 15),
    so it recomputes from 0, exactly; a third with the second's prompt resumes after the
    last full page before its last token (152 tokens), because the recompute gave the
    cache its windows back.
    The global tree, fed the engine's events, prices each the same, not as 120."""
    ref = hf_reference(gemma)
    [a] = random_prompts([200], 384, seed=71)
    b = a[:120] + random_prompts([40], 384, seed=72)[0]
    engine = make_engine(gemma, page_size=8, chunk_size=16, window_kv_tokens=40)
    windows = engine.scheduler.blocks.windows
    assert engine.pool.window.num_pages == 5 and engine.pool.window_tokens == 16
    tree = GlobalPrefixTree(1, page_size=8)
    tree.windows.windows[0] = engine.stats()["sliding_window"]
    cursor = mirrored(engine, tree, None)

    out, most = [], 0
    engine.add_request("a", a, {**GREEDY, "max_tokens": 12}, lambda o: out.extend(o.token_ids))
    engine.step()
    while engine.scheduler.has_work():
        engine.step()
        most = max(most, sum(1 for n in windows.need if n))
    assert out == ref.greedy(a, 12)
    assert most <= 5 and engine.pool.num_used >= 200 // 8  # the full layer kept every page
    cursor = mirrored(engine, tree, cursor)

    chain = array("Q", chain_hashes(b, 8))
    assert engine.cache.cached_len(b) == 0 and tree.match(chain).cached_on(0) == 0
    assert tree.match(chain).matched == 120  # the full layers' pages are there
    before = engine.stats()["prompt_tokens_cached"]
    assert engine.generate([b], {**GREEDY, "max_tokens": 8}) == [ref.greedy(b, 8)]
    assert engine.stats()["prompt_tokens_cached"] == before
    cursor = mirrored(engine, tree, cursor)

    assert engine.cache.cached_len(b) == 160 and tree.match(chain).cached_on(0) == 160
    assert engine.generate([b], {**GREEDY, "max_tokens": 8}) == [ref.greedy(b, 8)]
    assert engine.stats()["prompt_tokens_cached"] == before + 152
    mirrored(engine, tree, cursor)
    snapshot = GlobalPrefixTree(1, page_size=8)  # a router arriving now: the same picture
    snapshot.windows.windows[0] = 16
    mirrored(engine, snapshot, None)
    c = b[:136] + random_prompts([20], 384, seed=78)[0]
    # a's last window went while b ran twice; c leaves b's path after page 17, whose
    # window went as the third request's window slid past it
    for prompt, matched, hit in ((a, 200, 0), (b, 160, 160), (c, 136, 0)):
        chain = array("Q", chain_hashes(prompt, 8))
        assert engine.cache.cached_len(prompt) == hit and tree.match(chain).matched == matched
        assert tree.match(chain).cached_on(0) == snapshot.match(chain).cached_on(0) == hit


def test_preemption_and_many_requests_under_a_tight_window_pool(gemma, make_engine, hf_reference):
    """Eight requests sharing prefixes, in a window pool of two requests' windows and a
    device pool that preempts: every answer transformers' own, every page back (checked
    at teardown: both pools whole, no window page needed or idle)."""
    ref = hf_reference(gemma)
    [prefix] = random_prompts([72], 384, seed=73)
    prompts = [prefix + s for s in random_prompts([5, 30, 61, 9], 384, seed=74)]
    prompts += random_prompts([50, 130, 17, 88], 384, seed=75)
    engine = make_engine(gemma, page_size=8, chunk_size=24, max_num_tokens=256, window_kv_tokens=96)
    assert engine.generate(prompts, {**GREEDY, "max_tokens": 10}) == [ref.greedy(p, 10) for p in prompts]
    assert engine.stats()["num_preemptions"] > 0


def test_a_window_pool_too_small_for_one_request_is_refused_by_name(gemma, make_engine):
    with pytest.raises(ValueError, match="window_kv_tokens=32 is invalid.*sliding window \\(16\\)"):
        make_engine(gemma, page_size=8, chunk_size=16, window_kv_tokens=32)
    with pytest.raises(ValueError, match="host_kv_tokens / host_kv_ratio is invalid.*sliding-window"):
        make_engine(gemma, page_size=8, host_kv_tokens=256)


def test_e2_charges_the_recompute_of_a_prefix_whose_window_is_gone():
    """Both instances cache the same 32k-token prefix (page 16, window 4,096). Instance 0's
    engine reported the sliding KV of pages 1,000 on gone: a request sharing the whole
    prefix resumes there after page 1,000 (16,000 tokens; pages 744-999 hold its last
    window), so E2 charges it 33,280 - 16,000 tokens of prefill there and 512 on
    instance 1, and routes it to instance 1."""
    e2 = E2(2, "tiny_cpu", capacity_tokens=1 << 20, page_size=16, load_model="serial")
    for i in (0, 1):
        e2.learn(i, {"kv_pages_total": 1 << 16, "page_size": 16, "sliding_window": 4096})
    [doc] = random_prompts([32768], 384, seed=76)
    prompt = doc + random_prompts([512], 384, seed=77)[0]
    hashes = tuple(chain_hashes(doc, 16))
    for i in (0, 1):
        e2.tree.apply_events(i, [CacheEvent("stored", hashes, 0)])
    e2.tree.apply_events(0, [CacheEvent("evicted", hashes, 1000, "window")])
    match = e2.tree.match(array("Q", chain_hashes(prompt, 16)))
    assert match.matched == 32768 and match.cached_on(1) == 32768 and match.cached_on(0) == 16000
    now = e2.clock()
    gap = e2.load_cost(0, match, len(prompt), now) - e2.load_cost(1, match, len(prompt), now)
    assert gap == pytest.approx(e2.cost.prefill_time(33280 - 16000) - e2.cost.prefill_time(512))
    # the window comes back (a request recomputed it): the whole prefix is a hit again
    e2.tree.apply_events(0, [CacheEvent("stored", hashes[:1744], 744, "window")])
    assert e2.tree.match(array("Q", chain_hashes(prompt, 16))).cached_on(0) == 1744 * 16


def test_the_memory_benchmark_holds_one_window_and_a_chunk():
    """``benchmarks/sliding_memory`` (its 32k-token run is recorded in docs/benchmarks/
    engine.md) at a size the test suite affords: it fails unless both runs give the same
    tokens and no run needs more sliding KV than the window and a chunk."""
    from preble_backend.benchmarks import sliding_memory

    assert sliding_memory.main(["--context", "2048", "--window", "256", "--chunk", "128"]) == 0
