"""Copies ahead of eviction: beside a forward pass the host tier copies the pages the
device evicts next, so the eviction that later takes them waits for no copy. The pages
chosen are the ones LRU eviction takes first, the host makes their room from its own
pages and never from other copies, the router mirrors them, and the cost model charges
only what outlasts the forward pass."""

from __future__ import annotations

import torch
from conftest import make_request
from test_host_tier import PAGE, content, hosted_hashes, turns_pushed_out
from test_host_tier_admission import compute, tiered
from test_parity import expected

from preble_backend.common.block_hash import chain_hashes
from preble_backend.common.cost_model import CostModel
from preble_backend.engine.scheduling.local_scheduler import LocalScheduler
from preble_backend.engine.scheduling.priority_queue import PriorityWaitQueue
from scheduler.global_tree import GlobalPrefixTree


def doc(start: int, pages: int) -> list[int]:
    return list(range(start, start + pages * PAGE))


def write_kv(device, cache, tokens: list[int]) -> None:
    """Write a cached prefix's KV as if computed: each slot holds its token, in K and V."""
    for i, page in enumerate(cache.match_prefix(tokens)[0]):
        span = torch.tensor(tokens[i * PAGE : (i + 1) * PAGE], dtype=torch.float32)
        device.k_cache[0, page * PAGE : (page + 1) * PAGE, 0, 0] = span
        device.v_cache[0, page * PAGE : (page + 1) * PAGE, 0, 0] = span


def test_the_pages_copied_ahead_are_the_ones_evicted_next_and_cost_no_copy_then():
    """A, B, C cached in that order (4, 4 and 8 pages): a window of 6 copies A's four and
    the last two of B's, which eviction takes first; evicting 6 then moves exactly those
    down with no copy, and A comes back with its own tokens."""
    device, cache, blocks = tiered(24, 12)
    a, b, c = doc(100, 4), doc(200, 4), doc(300, 8)
    for rid, tokens in (("a", a), ("b", b), ("c", c)):
        compute(blocks, tokens, rid)
        write_kv(device, cache, tokens)
    mirror = GlobalPrefixTree(1, page_size=PAGE)
    mirror.apply_events(0, cache.drain_events())

    assert cache.copy_ahead(6) == 6
    stats = cache.host.stats
    assert (stats.pages_copied_ahead, stats.pages_offloaded, cache.num_host_pages) == (6, 0, 6)
    mirror.apply_events(0, cache.drain_events())
    expected = set(chain_hashes(a, PAGE)) | set(chain_hashes(b, PAGE)[2:])
    assert mirror.host.pages[0] == hosted_hashes(cache, PAGE) == expected
    assert cache.copy_ahead(6) == 0  # the same six: copied already

    device.free(cache.evict(6))
    assert (stats.pages_offloaded, stats.pages_reused) == (0, 6)
    assert cache.cached_len(a) == 4 * PAGE and len(cache.match_prefix(a)[0]) == 0  # A on the host
    assert len(cache.match_prefix(b)[0]) == 2 and len(cache.match_prefix(c)[0]) == 8
    reader = make_request(a + [1], "reader")
    assert blocks.admit(reader) == 4 * PAGE
    for i, page in enumerate(reader.page_table):
        assert content(device, page) == tuple(a[i * PAGE : (i + 1) * PAGE])
    blocks.release(reader)


def test_room_for_copies_ahead_comes_from_the_hosts_own_pages_never_from_copies():
    """A full host (D's four pages below nothing, A's copy of two) copying B's two ahead
    drops the last two of D, and A keeps its copy; with nothing of its own left the host
    copies no more, rather than trade one copy for another."""
    device, cache, blocks = tiered(8, 6)
    d, a, b = doc(100, 4), doc(200, 2), doc(300, 2)
    compute(blocks, d, "d")
    device.free(cache.evict(4))  # D's four pages go down
    compute(blocks, a, "a")
    assert cache.copy_ahead(2) == 2  # A's two: the host is full
    compute(blocks, b, "b")
    assert cache.copy_ahead(4) == 2  # A's (copied already), then B's two
    assert cache.cached_len(d) == 2 * PAGE  # D's tail dropped for them
    assert sum(len(n.host_copy) for n in cache.copies) == 4
    c = doc(400, 2)
    compute(blocks, c, "c")
    assert cache.copy_ahead(6) == 2  # A, B copied; C's two take the last of D
    assert cache.cached_len(d) == 0
    e = doc(500, 1)
    compute(blocks, e, "e")
    assert cache.copy_ahead(8) == 0  # only copies left on the host: E waits for its eviction
    assert sum(len(n.host_copy) for n in cache.copies) == 6


def test_a_batch_reports_its_copies_ahead_and_its_eviction_then_copies_nothing():
    """Chunks of 16 tokens (a window of four pages) over a device of eight: A's six pages
    cached, B's first chunk evicts A's last two (copied then, as nothing was ahead) and
    copies A's other four ahead, which B's second chunk evicts (three of them) copying
    nothing. The cost model charges the copies ahead only past the forward pass."""
    device, cache, blocks = tiered(8, 16)
    sched = LocalScheduler(blocks, PriorityWaitQueue(10, 10), 16, 8, copy_ahead=True)
    assert sched.copy_ahead == 4

    def run(prompt: list[int], rid: str) -> list[tuple[int, int]]:
        req, moved = make_request(prompt, rid), []
        sched.add(req)
        while req.num_computed < len(prompt):
            batch = sched.schedule()
            moved.append((batch.offloaded_tokens, batch.copied_ahead_tokens))
            moved_tokens = batch.loaded_tokens + batch.offloaded_tokens
            assert batch.work()[3:] == (moved_tokens, batch.copied_ahead_tokens)
            sched.advance(batch)
        sched.finish(req)
        return moved

    assert run(doc(100, 6) + [1], "a") == [(0, 0), (0, 0)]  # free pages left: nothing is due
    assert run(doc(200, 6) + [1], "b") == [(2 * PAGE, 4 * PAGE), (0, 0)]
    stats = cache.host.stats
    assert (stats.pages_offloaded, stats.pages_copied_ahead, stats.pages_reused) == (2, 4, 3)

    cost = CostModel(10.0, 0.5, 1.0, 0.0, 20.0, load_ms_per_token=0.25)
    assert cost.iteration_time(16, 0, 16, 8, 16) == 10 + 8 + 2  # 4 ms of copies ahead: hidden
    assert cost.iteration_time(0, 1, 1, 0, 80) == 20  # 11 ms of forward pass, 20 of copies ahead


def test_an_engine_copying_ahead_gives_transformers_tokens(any_model, make_engine, hf_reference):
    """A shared prefix pushed out by a prompt that fills the device between turns: it is
    copied down while the filler's chunks run, goes down later with no copy, and comes
    back with greedy tokens identical to transformers'; the router mirrors the host."""
    engine = make_engine(any_model, page_size=16, chunk_size=64, max_num_tokens=512,
                         host_kv_tokens=4096, host_copy_ahead=True)  # fmt: skip
    prompts, out = turns_pushed_out(engine, any_model)
    assert out == expected(hf_reference, any_model, prompts, 8)
    stats = engine.stats()
    assert stats["host_loadbacks"] >= 2 and stats["host_pages_copied_ahead"] > 0
    assert stats["host_pages_reused"] > 0  # evictions that found their copy made ahead
