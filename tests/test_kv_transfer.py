"""KV pages read across processes with NIXL (UCX, host memory): byte-exact, only the pages
asked for, a freed page detected by its stamp, a dead peer failed fast."""

from __future__ import annotations

import multiprocessing
import os
import signal
import time

import numpy as np
import pytest
import torch
from kv_peer import seeded_pool, serve

from preble_backend.kv_transfer.layout import PoolLayout, page_runs
from preble_backend.kv_transfer.nixl_transport import LATE, KVTransport


def test_page_runs_coalesce_pages_consecutive_on_both_sides():
    src, dst = page_runs([3, 4, 5, 9, 10, 20], [7, 8, 12, 13, 14, 15])
    assert src == [(3, 2), (5, 1), (9, 2), (20, 1)]
    assert dst == [(7, 2), (12, 1), (13, 2), (15, 1)]
    with pytest.raises(ValueError, match="2 source pages for 1 target"):
        page_runs([1, 2], [1])


def test_descriptors_name_each_layers_span_of_k_then_v():
    pool = seeded_pool(0)
    layout = PoolLayout.of(pool)
    rows = layout.page_descriptors([(5, 2)])
    assert rows.shape == (2 * 3, 3)  # K and V, 3 layers
    page = 4 * 2 * 8 * 4  # page_size × heads × head_dim × fp32
    assert layout.page_bytes == page and (rows[:, 1] == 2 * page).all()
    for layer in range(3):  # each row addresses exactly pool.page_view's pages 5..6 of that layer
        for cache, row in ((pool.k_cache, rows[layer]), (pool.v_cache, rows[3 + layer])):
            assert int(row[0]) == pool.page_view(cache)[layer, 5].data_ptr()


def test_pools_that_differ_are_refused_by_name():
    a, b = PoolLayout.of(seeded_pool(0)), PoolLayout.of(seeded_pool(0, page_size=8))
    assert a.mismatch(b) == "page_bytes differs: 256 here, 512 there"
    c = PoolLayout.of(seeded_pool(0, dtype=torch.float16))
    assert "differs" in a.mismatch(c)


@pytest.fixture
def peer():
    yield from _peer()


def _peer():
    ctx = multiprocessing.get_context("spawn")
    conn, child_conn = ctx.Pipe()
    process = ctx.Process(target=serve, args=(child_conn, 7), daemon=True)
    process.start()
    assert conn.poll(120), "the peer did not offer its pool"
    offer = conn.recv()
    yield conn, process, offer
    if process.is_alive():
        conn.send("stop")
        process.join(10)
    process.kill()


def _pages(pool, cache, pages):
    return pool.page_view(cache)[:, pages]


def test_read_moves_exactly_the_pages_asked_for(peer):
    conn, _, offer = peer
    mine = seeded_pool(99)  # different contents everywhere
    before = mine.k_cache.clone()
    transport = KVTransport("decode", mine)
    try:
        name = transport.connect(offer)
        remote, local = [3, 4, 5, 9, 20, 21], [10, 11, 30, 31, 32, 2]
        result = transport.read(name, remote, [0] * 6, local)
        assert result.ok and not result.stale and result.error == ""
        # runs consecutive on both sides: 3-4→10-11, 5→30, 9→31, 20→32, 21→2; K and V × 3 layers each
        assert result.bytes == 6 * 2 * 3 * 256 and result.descriptors == 5 * 2 * 3
        source = seeded_pool(7)
        for cache, theirs in ((mine.k_cache, source.k_cache), (mine.v_cache, source.v_cache)):
            assert torch.equal(_pages(mine, cache, local), _pages(source, theirs, remote))
        untouched = [p for p in range(64) if p not in local]
        assert torch.equal(_pages(mine, mine.k_cache, untouched), _pages(mine, before, untouched))
    finally:
        transport.close()


def test_a_page_freed_since_the_offer_is_detected_and_reported(peer):
    """The forced race: the prefill side frees (and could reuse) a page after offering it;
    the read reports it stale, so the caller decodes nothing from it."""
    conn, _, offer = peer
    mine = seeded_pool(99)
    transport = KVTransport("decode", mine)
    try:
        name = transport.connect(offer)
        conn.send(("free", [9]))
        assert conn.recv()[9] == 1
        result = transport.read(name, [3, 9, 20], [0, 0, 0], [1, 2, 3])
        assert not result.ok and result.stale == [9]
        assert result.error == "1 of 3 pages were freed on " + offer["name"] + " while read"
        # the stamps the peer now offers are current again
        assert transport.read(name, [3, 9, 20], [0, 1, 0], [1, 2, 3]).ok
    finally:
        transport.close()


def test_a_dead_peer_fails_the_read_fast(peer):
    _, process, offer = peer
    transport = KVTransport("decode", seeded_pool(99))
    try:
        name = transport.connect(offer)
        assert transport.read(name, [1], [0], [1]).ok
        process.kill()
        process.join(10)
        start = time.perf_counter()
        result = transport.read(name, [1, 2], [0, 0], [1, 2], timeout_s=3)
        assert not result.ok and "failed" in result.error
        assert time.perf_counter() - start < 4
        assert not transport.connected(name)  # a dead peer is not kept: each restart is a new one
    finally:
        transport.close()


def test_a_stalled_peer_fails_the_read_in_its_bound_and_the_pair_recovers(peer):
    """The peer stopped (SIGSTOP) before the first read wires the connection up: the read
    fails at its timeout, not later; once the peer runs again, the same pair reads."""
    _, process, offer = peer
    transport = KVTransport("decode", seeded_pool(99))
    try:
        name = transport.connect(offer)
        os.kill(process.pid, signal.SIGSTOP)
        try:
            start = time.perf_counter()
            result = transport.read(name, [1, 2], [0, 0], [1, 2], timeout_s=2)
            assert not result.ok and result.error == "the transfer did not finish in time"
            assert 2 <= time.perf_counter() - start < 3.5
        finally:
            os.kill(process.pid, signal.SIGCONT)
        assert transport.connected(name)  # a stalled peer is kept: it may answer later
        assert transport.read(name, [1, 2], [0, 0], [1, 2], timeout_s=10).ok
    finally:
        transport.close()


def test_stamps_advance_on_every_free():
    pool = seeded_pool(0)
    pages = pool.alloc(3)
    pool.free(pages)
    assert pool.stamps[pages].tolist() == [1, 1, 1]
    again = pool.alloc(3)  # the same pages: the free list is a stack
    pool.free(again[:1])
    assert pool.stamps[again].tolist() == [2, 1, 1] and np.count_nonzero(pool.stamps) == 3


@pytest.fixture
def tcp_peer(monkeypatch):
    """A peer over UCX's TCP transport, where a read needs the peer to answer it."""
    monkeypatch.setenv("UCX_TLS", "tcp")
    yield from _peer()


def test_a_read_that_times_out_holds_its_pages_until_it_can_no_longer_write_them(tcp_peer):
    """The peer stopped (SIGSTOP) after the pair is wired up: the read times out, and its
    data lands when the peer runs again, whatever NIXL says of the handle. So its pages are
    held (nobody may be given them meanwhile) and handed back once the read has ended,
    holding what it wrote; the pair reads on."""
    conn, process, offer = tcp_peer
    mine = seeded_pool(99)
    settled: list[list[int]] = []
    transport = KVTransport("decode", mine, on_settled=settled.append)
    try:
        name = transport.connect(offer)
        assert transport.read(name, [1], [0], [1]).ok
        os.kill(process.pid, signal.SIGSTOP)
        try:
            result = transport.read(name, [5, 6], [0, 0], [5, 6], timeout_s=1)
        finally:
            os.kill(process.pid, signal.SIGCONT)
        assert not result.ok and result.error == LATE and result.held == [5, 6]
        assert transport.connected(name)  # a stalled peer is kept
        deadline = time.monotonic() + 10
        while not settled and time.monotonic() < deadline:
            time.sleep(0.05)
        assert settled == [[5, 6]] and transport.held_pages == 0
        source = seeded_pool(7)
        assert torch.equal(_pages(mine, mine.k_cache, [5, 6]), _pages(source, source.k_cache, [5, 6]))
        assert transport.read(name, [3, 9], [0, 0], [3, 9]).ok
    finally:
        transport.close()
