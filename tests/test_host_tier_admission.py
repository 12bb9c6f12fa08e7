"""Admission over a host tier, at the block manager: how much of a prefix on the host
comes back for the room the device has, the room kept for the chunk after it, the host
copy a loaded-back prefix keeps, and waiting for room while others run."""

from __future__ import annotations

from conftest import make_request
from test_host_tier import PAGE, pool
from test_radix_cache import chunked_prefill

from preble_backend.engine.cache.host_tier import HostTier
from preble_backend.engine.cache.radix_cache import RadixCache
from preble_backend.engine.scheduling.block_manager import BlockManager
from preble_backend.engine.scheduling.local_scheduler import LocalScheduler
from preble_backend.engine.scheduling.priority_queue import PriorityWaitQueue
from preble_backend.model.kv_pool import KVPool


def tiered(device_pages: int, host_pages: int) -> tuple[KVPool, RadixCache, BlockManager]:
    """A radix cache over a device pool and a host tier, and its block manager."""
    device = pool(device_pages)
    cache = RadixCache(PAGE, HostTier(device, pool(host_pages)))
    return device, cache, BlockManager(device, cache)


def compute(blocks: BlockManager, tokens: list[int], rid: str, chunk_pages: int = 3) -> None:
    """Admit ``tokens`` (and one more), compute them chunk by chunk and release them: the
    cache holds their pages."""
    req = make_request(tokens + [1], rid)
    blocks.admit(req)
    assert chunked_prefill(blocks, req, chunk_pages)
    blocks.release(req)


def test_a_load_back_takes_what_the_device_has_room_for():
    """Six pages on the host, room for four on the device (the rest held by running
    requests): the first four come back, the request computes the other two."""
    device, cache, blocks = tiered(8, 16)
    tokens = list(range(100, 100 + 6 * PAGE))
    compute(blocks, tokens, "a")
    device.free(cache.evict(cache.num_pages))  # all six pages move down
    assert cache.num_host_pages == 6
    held = device.alloc(4)  # running requests' pages: four remain free
    second = make_request(tokens + [2], "b")
    assert blocks.admit(second) == 4 * PAGE
    assert cache.host.stats.pages_short == 2
    assert cache.num_host_pages == 6 and sum(len(n.host_copy) for n in cache.copies) == 4  # kept
    assert cache.cached_len(tokens) == 6 * PAGE  # the other two still on the host
    blocks.release(second)
    device.free(held)


def test_a_load_back_keeps_room_for_the_chunk_after_it():
    """The first chunk a request computes begins where its load-back ends: six pages on
    the host come back whole into a device of eight, beside the one page left to compute,
    while others run (before, room was kept for a chunk from the device prefix's end: a
    chunk as long as the prompt kept seven pages free, and the request waited for room it
    would never use, or took one page and recomputed five)."""
    device, cache, blocks = tiered(8, 16)
    tokens = list(range(100, 100 + 6 * PAGE))
    compute(blocks, tokens, "a")
    device.free(cache.evict(cache.num_pages))  # all six pages move down
    for wait, rid in ((True, "waits"), (False, "alone")):
        req = make_request(tokens + [2], rid)
        assert blocks.admit(req, first_chunk=8 * PAGE, wait=wait) == 6 * PAGE
        assert blocks.reserve(req, 1) and cache.host.stats.pages_short == 0
        blocks.release(req)
        device.free(cache.evict(cache.num_pages))


def test_a_prefix_loaded_back_keeps_its_host_copy_until_the_host_needs_room():
    """As HiCache keeps a loaded-back node's host value: evicting a prefix that came back
    from the host copies nothing (write-back copied it down again each time, 2.6 times the
    pages write-through would on chat). A host that needs room for an offload drops such
    copies before the pages only it holds: A's copy goes for C, B stays; A's eviction then
    copies A down again, and the host's own least recently used leaf (B) makes its room."""
    device, cache, blocks = tiered(8, 6)
    host = cache.host.pool
    doc_a, doc_b, doc_c = (list(range(s, s + n * PAGE)) for s, n in ((100, 4), (200, 2), (300, 2)))
    for doc in (doc_a, doc_b):
        compute(blocks, doc, f"first {doc[0]}", 4)
        device.free(cache.evict(cache.num_evictable_pages))  # down to the host
    stats = cache.host.stats
    assert (stats.pages_offloaded, cache.num_host_pages, host.num_free) == (6, 6, 0)
    compute(blocks, doc_a, "again", 4)  # A comes back, and the host keeps its copy
    assert (stats.pages_loaded, cache.num_host_pages) == (4, 6)
    device.free(cache.evict(cache.num_evictable_pages))  # A goes down again: nothing copied
    assert (stats.pages_offloaded, stats.pages_reused, cache.num_host_pages) == (6, 4, 6)
    compute(blocks, doc_a, "third", 4)
    compute(blocks, doc_c, "c", 4)
    cache.touch(doc_a)
    device.free(cache.evict(2))  # C goes down: the host makes room by dropping A's copy, not B
    assert cache.cached_len(doc_b) == 2 * PAGE and len(cache.match_prefix(doc_a)[0]) == 4
    assert (cache.num_host_pages, stats.pages_offloaded, cache.copies) == (4, 8, set())
    device.free(cache.evict(4))  # A goes down, copied again: B, the older host leaf, goes
    assert (stats.pages_offloaded, cache.num_host_pages) == (12, 6)
    assert [cache.cached_len(d) for d in (doc_a, doc_b, doc_c)] == [4 * PAGE, 0, 2 * PAGE]
    assert cache.evict_host(4) >= 4 and cache.num_host_pages <= 2


def test_room_for_an_offload_drops_the_most_recently_used_nodes_copy_first():
    """X and Y come back from a full host of four pages, keeping their copies; Y is used
    last. Z, computed before them, is evicted first and needs two host pages: Y's copy goes
    (Y is evicted last), X's stays, and X's eviction copies nothing."""
    device, cache, blocks = tiered(8, 4)
    doc_x, doc_y, doc_z = (list(range(s, s + 2 * PAGE)) for s in (100, 200, 300))
    for doc in (doc_x, doc_y):
        compute(blocks, doc, f"first {doc[0]}", 2)
    device.free(cache.evict(cache.num_evictable_pages))
    compute(blocks, doc_z, "z", 2)
    for doc in (doc_x, doc_y):
        compute(blocks, doc, f"again {doc[0]}", 2)  # loaded back, copies kept: the host is full
    stats = cache.host.stats
    assert (stats.pages_loaded, cache.host.pool.num_free, len(cache.copies)) == (4, 0, 2)
    device.free(cache.evict(2))  # Z
    assert [n.path_tokens() for n in cache.copies] == [doc_x]
    assert [cache.cached_len(d) for d in (doc_x, doc_y, doc_z)] == [2 * PAGE] * 3
    device.free(cache.evict(2))  # X: its copy was kept, so nothing is copied
    assert (stats.pages_offloaded, stats.pages_reused) == (6, 2)


def test_a_prefix_on_the_host_waits_for_room_to_come_back_whole():
    """Six pages of a prefix on the host, and while another request runs the device can
    free only three: the reader waits, and nothing is evicted or copied for it (before,
    each iteration pushed the device's cache down and brought part of the prefix up for a
    request that was then not admitted). Once the running request is done, it all comes
    back and the reader computes none of it."""
    device, host = pool(12), pool(16)
    cache = RadixCache(PAGE, HostTier(device, host))
    sched = LocalScheduler(BlockManager(device, cache), PriorityWaitQueue(10, 10), 8, 8)
    doc_a, doc_b = list(range(100, 100 + 6 * PAGE)), list(range(200, 200 + 2 * PAGE))
    for rid, prompt in (("a", doc_a + [1]), ("b", doc_b + [1])):
        req = make_request(prompt, rid)
        sched.add(req)
        while req.num_computed < len(prompt):
            sched.advance(sched.schedule())
        sched.finish(req)
        if rid == "a":
            device.free(cache.evict(cache.num_evictable_pages))  # all of A moves down
    assert cache.num_host_pages == 6 and cache.num_pages == 2  # A on the host, B on the device
    running = make_request(list(range(300, 300 + 2 * PAGE + 1)), "running")
    sched.add(running)
    sched.advance(sched.schedule())  # its first chunk: two pages, one token left to compute
    held = device.alloc(device.num_free - 2)  # other requests' pages: two stay free
    reader = make_request(doc_a + [2], "reader")
    sched.add(reader)
    offloaded = cache.host.stats.pages_offloaded
    batch = sched.schedule()  # room: one free page after the running request's, B's two
    assert batch.requests == [running] and reader in list(sched.waiting)
    assert len(cache.match_prefix(doc_b)[0]) == 2 and cache.num_host_pages == 6  # B kept, A untouched
    stats = cache.host.stats
    assert (stats.pages_loaded, stats.pages_offloaded, stats.pages_short) == (0, offloaded, 0)
    sched.advance(batch)
    sched.finish(running)
    device.free(held)
    batch = sched.schedule()
    assert batch.requests == [reader] and reader.num_cached_tokens == 6 * PAGE
    assert (stats.pages_loaded, stats.pages_short) == (6, 0)
    sched.finish(reader)


def test_a_batch_is_charged_the_copies_that_formed_it_both_ways():
    """The engine waits for every copy between tiers, offloads too (one synchronisation
    per eviction), so the batch whose evictions moved pages down reports them beside its
    load-backs and the cost model charges both; pages moved down with no copy, because the
    host kept theirs since a load-back, are not charged (before, the simulator and the
    emulated engines charged load-backs alone, and the offloads were free)."""
    device, cache, blocks = tiered(8, 16)
    sched = LocalScheduler(blocks, PriorityWaitQueue(10, 10), 32, 8)
    doc_a, doc_b = list(range(100, 100 + 6 * PAGE)), list(range(200, 200 + 6 * PAGE))

    def run(prompt: list[int], rid: str) -> list[tuple[int, int]]:
        req, moved = make_request(prompt, rid), []
        sched.add(req)
        while req.num_computed < len(prompt):
            before = cache.host.stats.pages_offloaded, cache.host.stats.pages_loaded
            batch = sched.schedule()
            after = cache.host.stats.pages_offloaded, cache.host.stats.pages_loaded
            offloaded, loaded = ((a - b) * PAGE for a, b in zip(after, before))
            assert (batch.offloaded_tokens, batch.loaded_tokens) == (offloaded, loaded)
            assert batch.work()[3] == offloaded + loaded
            moved.append((offloaded, loaded))
            sched.advance(batch)
        sched.finish(req)
        return [m for m in moved if m != (0, 0)]

    assert run(doc_a + [1], "a") == []
    # B's seven pages: two free, five of A's six go down to make room
    assert run(doc_b + [1], "b") == [(5 * PAGE, 0)]
    assert cache.num_host_pages == 5 and not cache.copies
    # A's five come back beside the page it computes; five of B's go down for them
    assert run(doc_a + [2], "a again") == [(5 * PAGE, 5 * PAGE)]
    assert sum(len(n.host_copy) for n in cache.copies) == 5  # A's keep their host copy
    # B's five come back; A's five go down copying nothing
    assert run(doc_b + [2], "b again") == [(0, 5 * PAGE)]
    assert cache.host.stats.pages_reused == 5
