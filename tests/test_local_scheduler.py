"""The paper's priority wait queue and the iteration batches the local scheduler forms."""

from __future__ import annotations

import pytest
from conftest import make_request, random_prompts, tiny_pool

from preble_backend.engine.cache.host_tier import HostTier
from preble_backend.engine.cache.radix_cache import RadixCache
from preble_backend.engine.scheduling.block_manager import BlockManager
from preble_backend.engine.scheduling.local_scheduler import LocalScheduler
from preble_backend.engine.scheduling.priority_queue import PriorityWaitQueue


@pytest.mark.parametrize(
    "cached, prompt, group",
    [(63, 100, 6), (0, 100, 0), (1, 100, 0), (10, 100, 0), (11, 100, 1), (100, 100, 9), (99, 100, 9)],
)
def test_group_is_ceil_of_hit_ratio_times_p_minus_one(cached, prompt, group):
    # The paper's example: 63 of 100 tokens cached with P = 10 is priority six.
    assert PriorityWaitQueue(10, 10).group_for(cached, prompt) == group


def test_round_quotas_are_g_plus_one_times_k_fcfs_inside_a_group():
    q = PriorityWaitQueue(num_groups=3, quota_unit=2)  # quotas 2, 4, 6 for groups 0, 1, 2
    reqs = {g: [make_request([g], rid=f"{g}-{i}") for i in range(8)] for g in range(3)}
    for g in range(3):
        for r in reqs[g]:
            q.push(r, g)
    admitted = []
    for _ in range(3):  # three scheduling steps admitting 4 requests each
        for r in list(q.candidates())[:4]:
            q.take(r)
            admitted.append(r.request_id)
    # Round one: all 6 of group 2, then 4 of group 1, then 2 of group 0 (12 = 2 + 4 + 6).
    assert admitted == [f"2-{i}" for i in range(6)] + [f"1-{i}" for i in range(4)] + ["0-0", "0-1"]
    # Round two starts with fresh quotas: group 2's remaining two lead again.
    assert [r.request_id for r in q.candidates()][:3] == ["2-6", "2-7", "1-4"]


def test_preempted_request_goes_to_the_front_of_its_group():
    q = PriorityWaitQueue(2, 1)
    a, b, c = (make_request([i], rid=i) for i in range(3))
    q.push(a, 1)
    q.push(b, 1)
    q.push(c, 1, front=True)
    assert [r.request_id for r in q.candidates()] == ["2", "0"]  # group 1's quota: (1 + 1) * 1
    assert q.remove(b) and not q.remove(b)
    assert len(q) == 2


def make_scheduler(chunk_size=8, max_running=8, num_pages=24):
    pool = tiny_pool(num_pages)
    blocks = BlockManager(pool, RadixCache(pool.page_size))
    return LocalScheduler(blocks, PriorityWaitQueue(10, 10), chunk_size, max_running)


def test_batches_mix_decodes_and_prefill_chunks_under_the_token_budget():
    sched = make_scheduler(chunk_size=8)
    long, short = make_request(list(range(20)), "long"), make_request([7, 8, 9], "short")
    sched.add(long)
    sched.add(short)
    batch = sched.schedule()
    assert [(r.request_id, n) for r, n in zip(batch.requests, batch.num_new_tokens)] == [("long", 8)]
    sched.advance(batch)
    batch = sched.schedule()  # long continues its prefill, short gets nothing yet (budget 8)
    assert [(r.request_id, n) for r, n in zip(batch.requests, batch.num_new_tokens)] == [("long", 8)]
    sched.advance(batch)
    batch = sched.schedule()  # long's last 4 tokens, then short's whole prompt
    assert [(r.request_id, n) for r, n in zip(batch.requests, batch.num_new_tokens)] == [
        ("long", 4),
        ("short", 3),
    ]
    sched.advance(batch)
    long.output_ids.append(1)  # both sampled a token: now they decode one token each
    short.output_ids.append(1)
    batch = sched.schedule()
    assert batch.num_new_tokens == [1, 1]
    for r in (long, short):
        sched.finish(r)


def test_running_cap_holds_requests_back():
    sched = make_scheduler(chunk_size=64, max_running=2)
    reqs = [make_request(p, i) for i, p in enumerate(random_prompts([5, 5, 5], 50))]
    for r in reqs:
        sched.add(r)
    assert len(sched.schedule()) == 2 and len(sched.waiting) == 1
    for r in reqs:
        sched.finish(r)


def test_out_of_pages_preempts_the_newest_request():
    # 6 pages of 4 tokens; two requests of 10 tokens use 3 pages each; the first to grow
    # past its third page forces the newer one out.
    sched = make_scheduler(chunk_size=64, num_pages=6)
    old, new = make_request(list(range(10)), "old"), make_request(list(range(50, 62)), "new")
    sched.add(old)
    sched.add(new)
    sched.advance(sched.schedule())
    for r, extra in ((old, [1, 2, 3]), (new, [])):
        r.output_ids.extend(extra)  # old now holds 13 tokens: it needs a fourth page
        r.num_computed = r.num_tokens - 1 if extra else r.num_computed
    batch = sched.schedule()
    assert batch.requests == [old] and sched.stats.num_preemptions == 1
    assert new in list(sched.waiting) and new.num_computed == 0
    for r in (old, new):
        sched.finish(r)


def test_a_prompt_is_admitted_only_when_all_of_it_fits():
    """12 pages of 4 tokens, a 16-token budget. A's 28-token prompt (7 pages) runs two
    passes; in the second, 4 tokens of budget are left for B's 24-token prompt (6 pages),
    but only 5 pages are free and none evictable (A holds its own). Admitted on its first
    chunk's page, B would run the pool dry halfway and one of the two would be preempted;
    so B waits, and is admitted whole once A lets go of its pages."""
    sched = make_scheduler(chunk_size=16, num_pages=12)
    a, b = make_request(list(range(100, 128)), "a"), make_request(list(range(200, 224)), "b")
    sched.add(a)
    sched.advance(sched.schedule())
    sched.add(b)
    batch = sched.schedule()
    assert batch.requests == [a] and batch.num_new_tokens == [12] and b in list(sched.waiting)
    sched.advance(batch)
    sched.finish(a)  # its pages go to the cache, evictable
    batch = sched.schedule()
    assert batch.requests == [b] and batch.num_new_tokens == [16]
    assert sched.stats.num_preemptions == 0
    sched.finish(b)
    sched.blocks.free(sched.blocks.cache.reset())
    assert sched.blocks.pool.num_free == 12


def test_a_prefix_on_the_host_is_not_loaded_back_for_a_prompt_that_would_not_fit():
    """12 device pages of 4 tokens. A 16-token document went down to the host tier; a
    request decodes holding 6 pages; a 5-token budget. A reader of the document with 12
    tokens more needs 7 pages: its first chunk's page and the 4 it loads back would fit in
    the 6 free, the whole prompt would not, so nothing is loaded or evicted for it and it
    waits; once the other finishes it is admitted, its document loaded back."""
    device, host = tiny_pool(12), tiny_pool(12)
    blocks = BlockManager(device, RadixCache(device.page_size, HostTier(device, host)))
    sched = LocalScheduler(blocks, PriorityWaitQueue(10, 10), chunk_size=5, max_running_requests=8)
    doc = list(range(100, 116))
    first = make_request(doc + [1], "first")
    sched.add(first)
    while first.num_computed < first.num_tokens:
        sched.advance(sched.schedule())
    sched.finish(first)
    blocks.free(blocks.cache.evict(blocks.cache.num_evictable_pages))  # down to the host
    big = make_request(list(range(300, 322)), "big")  # 22 tokens: 6 pages
    sched.add(big)
    while big.num_computed < big.num_tokens:
        sched.advance(sched.schedule())
    big.output_ids.append(7)  # it decodes now
    stats = blocks.cache.host.stats
    moved = (stats.pages_loaded, stats.pages_offloaded)
    reader = make_request(doc + list(range(400, 412)), "reader")
    sched.add(reader)
    batch = sched.schedule()
    assert batch.requests == [big] and reader in list(sched.waiting)
    assert (stats.pages_loaded, stats.pages_offloaded) == moved and device.num_free == 6
    sched.advance(batch)
    sched.finish(big)
    batch = sched.schedule()
    assert batch.requests == [reader] and stats.pages_loaded == moved[0] + 4
    sched.finish(reader)
    blocks.free(blocks.cache.reset())
    assert device.num_free == 12


@pytest.mark.parametrize("waiting", [True, False])
def test_eviction_spares_the_prefix_a_waiting_request_will_reuse(waiting):
    """Two cached documents, A older than B, and a fresh prompt's chunked prefill that
    takes the whole token budget and needs two pages more than are free. With a request
    for A waiting behind it, B's tail goes; with nobody waiting, LRU takes A's."""
    sched = make_scheduler(chunk_size=8, num_pages=12)  # pages of 4 tokens
    doc_a, doc_b, fresh = list(range(100, 116)), list(range(200, 216)), list(range(300, 324))
    for rid, prompt in (("a", doc_a + [1]), ("b", doc_b + [1])):  # each leaves 4 pages cached
        req = make_request(prompt, rid)
        sched.add(req)
        while req.num_computed < len(prompt):
            sched.advance(sched.schedule())
        sched.finish(req)
    cache = sched.blocks.cache
    assert cache.cached_len(doc_a) == cache.cached_len(doc_b) == 16 and sched.blocks.pool.num_free == 4
    running, reader = make_request(fresh, "fresh"), make_request(doc_a + [2], "reader")
    sched.add(running)
    for i in range(3):  # 8 tokens each: the third needs two pages the pool no longer has
        batch = sched.schedule()
        assert batch.requests == [running]
        sched.advance(batch)
        if i == 0:  # the reader arrives behind a running prefill that takes the whole budget
            sched.add(reader)
            if not waiting:
                sched.finish(reader)
    spared, evicted = (doc_a, doc_b) if waiting else (doc_b, doc_a)
    assert cache.cached_len(spared) == 16 and cache.cached_len(evicted) == 8
    sched.finish(running)
    if waiting:
        batch = sched.schedule()
        assert batch.requests == [reader] and reader.num_cached_tokens == 16


def test_a_reserve_no_eviction_can_satisfy_keeps_the_cache():
    """Five pages asked for where two are free and two cached: no eviction makes the room,
    so none happens (the cached document stays for the requests that will want it)."""
    sched = make_scheduler(chunk_size=64, num_pages=8)
    doc = make_request(list(range(100, 108)) + [1], "doc")  # leaves two pages cached
    sched.add(doc)
    sched.advance(sched.schedule())
    sched.finish(doc)
    blocks, cache = sched.blocks, sched.blocks.cache
    held = blocks.pool.alloc(blocks.pool.num_free - 2)
    big = make_request(list(range(300, 324)), "big")
    assert not blocks.reserve(big, 20)
    assert cache.num_pages == 2 and cache.cached_len(list(range(100, 108))) == 8
    assert blocks.reserve(big, 8)  # two pages: the free ones, the cache still whole
    assert cache.num_pages == 2
    blocks.release(big)
    blocks.pool.free(held)


@pytest.mark.parametrize("received", [True, False])
def test_a_received_request_joins_the_next_pass_ahead_of_a_running_prefill(received):
    """P/D: a request whose prompt's KV came from a prefill instance lacks one token of it.
    Behind a fresh prompt's chunked prefill that takes the whole budget (8), it is admitted
    in the next pass, the prefill keeping the budget less a page (8 - 4) for that pass; the
    same request not received waits behind the prefill, as the paper's queue has it."""
    sched = make_scheduler(chunk_size=8, num_pages=24)  # pages of 4 tokens
    doc = list(range(100, 116))
    warm = make_request(doc + [1], "warm")  # leaves doc's four pages cached, as a transfer does
    sched.add(warm)
    while warm.num_computed < len(warm.prompt_ids):
        sched.advance(sched.schedule())
    sched.finish(warm)
    fresh = make_request(list(range(300, 340)), "fresh")
    sched.add(fresh)
    sched.advance(sched.schedule())
    moved = make_request(doc + [2], "moved")
    moved.received = received
    sched.add(moved)
    assert sched.ready == ([moved] if received else [])
    shape = []
    while moved.num_cached_tokens is None:
        batch = sched.schedule()
        shape.append([(r.request_id, n) for r, n in zip(batch.requests, batch.num_new_tokens)])
        sched.advance(batch)
    if received:
        assert shape == [[("fresh", 4), ("moved", 1)]] and sched.ready == []
    else:  # fresh's 32 tokens left, in passes of 8, before it
        assert shape == [[("fresh", 8)]] * 4 + [[("moved", 1)]]
    assert moved.num_cached_tokens == 16
    for r in (fresh, moved):
        sched.finish(r)


def _step(sched):
    """One pass, each request that computed its last token given its next (a decode), and
    finished at its ``max_tokens`` as the engine does."""
    batch = sched.schedule()
    sched.advance(batch)
    for r in batch.requests:
        if r.num_computed >= r.num_tokens:
            r.output_ids.append(0)
            if len(r.output_ids) >= r.params.max_tokens:
                sched.finish(r)
    return batch


def _received(sched, doc, rid):
    """``doc``'s pages cached as a transfer leaves them, and a request for it, received."""
    pages = sched.blocks.pool.alloc(len(doc) // sched.blocks.page_size)
    sched.blocks.cache.insert(doc, pages)
    moved = make_request(doc + [2], rid)
    moved.received = True
    return moved


@pytest.mark.parametrize("received", [True, False])
def test_a_received_prompt_keeps_its_pages_until_it_is_admitted(received):
    """A received prompt waits for a running slot while the running request's decode needs
    the pool: its pages are not evicted for it (the decode yields, preempted, and the
    received request is admitted on all 16 moved tokens), where a prompt merely cached
    loses its last page to that decode. Every page comes back."""
    sched = make_scheduler(chunk_size=8, max_running=1, num_pages=8)  # 4 tokens a page
    moved = _received(sched, list(range(100, 116)), "moved")  # 4 of the 8 pages cached
    moved.received = received
    decode = make_request(list(range(300, 308)), "decode")
    decode.params = decode.params.__class__(max_tokens=12)  # to 20 tokens: a fifth page
    sched.add(decode)
    _step(sched)
    sched.add(moved)
    assert (moved.held_node is not None) == received
    while moved.num_cached_tokens is None:
        _step(sched)
    assert moved.num_cached_tokens == (16 if received else 12) and moved.held_node is None
    assert decode.num_preemptions == (1 if received else 0)
    while sched.has_work():
        _step(sched)
    pool, cache = sched.blocks.pool, sched.blocks.cache
    assert pool.num_used == cache.num_pages == cache.num_evictable_pages  # nothing locked or lost


def test_a_received_prompt_that_leaves_before_admission_lets_its_pages_go():
    sched = make_scheduler(chunk_size=8, max_running=1, num_pages=12)
    moved = _received(sched, list(range(100, 116)), "moved")
    blocker = make_request(list(range(300, 304)), "blocker")
    sched.add(blocker)
    _step(sched)
    evictable = sched.blocks.cache.num_evictable_pages
    sched.add(moved)
    assert sched.blocks.cache.num_evictable_pages == evictable - 4
    sched.finish(moved)  # cancelled while it waited
    assert moved.held_node is None and sched.blocks.cache.num_evictable_pages == evictable


def test_held_pages_that_leave_no_room_for_any_waiting_prompt_are_let_go():
    """Two received prompts hold all 6 pages while nothing runs, and each needs one more
    for its last token: rather than wait for ever, the holds are let go, the first is
    admitted on a page of the second's, and every page comes back."""
    sched = make_scheduler(chunk_size=16, max_running=4, num_pages=6)
    first = _received(sched, list(range(100, 112)), "first")
    second = _received(sched, list(range(200, 212)), "second")
    sched.add(first)
    sched.add(second)
    assert sched.blocks.pool.num_free == sched.blocks.cache.num_evictable_pages == 0
    batch = _step(sched)
    assert [(r.request_id, n) for r, n in zip(batch.requests, batch.num_new_tokens)] == [("first", 1)]
    assert first.held_node is None and second.held_node is None and first.num_cached_tokens == 12
    while sched.has_work():
        _step(sched)
    assert second.num_cached_tokens == 8  # its last page went to the first
    assert sched.blocks.pool.num_used == sched.blocks.cache.num_evictable_pages
