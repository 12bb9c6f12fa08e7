"""The KV handoff between tensor-parallel engines: each of two ranks reads its own slice
of the pages through NIXL (``rank_transport.py``), two real TP-2 engines on the CPU (the
embedded tiny model, fp32, gloo). The decode side answers as a one-rank engine would
aggregated, with a partial prefix of its own, a stale read is never decoded from, and
engines whose ranks differ are refused by name."""

from __future__ import annotations

import os
import signal
import time

import pytest

from preble_backend.engine.config import EngineConfig
from preble_backend.engine.engine import Engine
from preble_backend.engine.scheduling.handoff import Handoff
from preble_backend.engine_server.kv_exchange import transport_for
from preble_backend.kv_transfer.nixl_transport import LATE, KVTransport
from tests.test_kv_handoff import GREEDY, SEEDED, a_stale_read_prefills_here, all_pages_back, prompt, take


@pytest.fixture(scope="module")
def tp_pair(tiny_model):
    """(one-rank reference engine, TP-2 prefill engine, TP-2 decode engine, the decode
    side's transport, the peer it reads, the held pages it has handed back)."""
    with pytest.MonkeyPatch.context() as env:
        env.setenv("UCX_TLS", "tcp")  # every rank's agents: a read needs its peer to answer (a stall holds)
        ref = Engine(EngineConfig(model_path=tiny_model, max_num_tokens=4096))
        p, d = (Engine(EngineConfig(model_path=tiny_model, max_num_tokens=4096, tensor_parallel_size=2))
                for _ in range(2))  # fmt: skip
        settled: list[list[int]] = []
        tp = transport_for(p, "prefill-tp")
        td = transport_for(d, "decode-tp", on_settled=settled.append)
        peer = td.connect(tp.offer())
        yield ref, p, d, td, peer, settled
        td.close()
        tp.close()
        for engine in (ref, p, d):
            engine.shutdown()


def reader(td, peer, timeout_s: float = 5.0):
    return lambda remote, stamps, local: td.read(peer, remote, stamps, local, timeout_s)


@pytest.mark.parametrize("params", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_tp2_decode_side_answers_as_one_rank_aggregated(tp_pair, params):
    """The decode side already holds the prompt's first 64 tokens (an earlier request): only
    the pages after them move, each rank its half of the KV heads, and its answer is the
    one-rank engine's."""
    ref, p, d, td, peer, _ = tp_pair
    tokens = prompt(21 if params is GREEDY else 22)
    [aggregated] = ref.generate([tokens], params)
    assert p.generate([tokens], params) == [aggregated]
    d.generate([tokens[:64] + prompt(23, 40)], GREEDY)
    ps = p.pool.page_size
    handoff = Handoff(p.scheduler.blocks)
    offer = handoff.offer("r", tokens)
    received, result = take(Handoff(d.scheduler.blocks), tokens, offer, reader(td, peer))
    moved = len(tokens) // ps - 64 // ps
    assert result.ok and result.pages == moved and received == moved * ps
    assert result.bytes == 2 * moved * p.pool.k_cache.shape[0] * td.layout.page_bytes * 2  # K+V, both ranks
    before = d.scheduler.stats.prompt_tokens_cached
    assert d.generate([tokens], params) == [aggregated]
    assert d.scheduler.stats.prompt_tokens_cached - before == offer["tokens"]
    assert handoff.release("r")
    all_pages_back(p)
    all_pages_back(d)


def test_tp2_a_page_freed_after_the_offer_is_never_decoded_from(tp_pair):
    """The lease ends and the prefill side evicts the prompt before the read: rank 0's
    stamps read after both ranks' data find every page stale, nothing is cached, and the
    decode side prefills and answers the same."""
    ref, p, d, td, peer, _ = tp_pair
    tokens = prompt(25)
    [aggregated] = ref.generate([tokens], GREEDY)
    p.generate([tokens], GREEDY)
    handoff = Handoff(p.scheduler.blocks, ttl_s=0.0)
    offer = handoff.offer("r", tokens)
    assert handoff.expire() == 1
    p.scheduler.blocks.free(p.cache.evict(p.cache.num_evictable_pages))
    a_stale_read_prefills_here(p, d, reader(td, peer), tokens, offer, aggregated)


def test_tp2_a_rank_whose_read_stalls_holds_the_pages_until_it_has_ended(tp_pair):
    """The prefill engine's second rank stopped (SIGSTOP) mid-handoff, over UCX's TCP
    transport (where a read needs its peer to answer): that rank's read times out while
    rank 0's succeeds, so the handoff fails, nothing is cached, and the pages stay out of
    use until the stalled read has ended after the peer runs again; then they come back
    and the pair reads on, the answer the one-rank engine's."""
    ref, p, d, td, peer, settled = tp_pair
    tokens = prompt(27)
    [aggregated] = ref.generate([tokens], GREEDY)
    p.generate([tokens], GREEDY)
    handoff = Handoff(p.scheduler.blocks)
    offer = handoff.offer("r", tokens)
    free = d.pool.num_free
    follower = p.runner.ranks.processes[0].pid
    os.kill(follower, signal.SIGSTOP)
    try:
        start = time.perf_counter()
        received, result = take(Handoff(d.scheduler.blocks), tokens, offer, reader(td, peer, 1.0))
        assert time.perf_counter() - start < 1.0 + 3.0  # the timeout and its grace
    finally:
        os.kill(follower, signal.SIGCONT)
    assert received == 0 and not result.ok and result.error == LATE
    assert result.held and d.pool.num_free == free - len(result.held) and td.held_pages == len(result.held)
    deadline = time.monotonic() + 10
    while not settled and time.monotonic() < deadline:
        time.sleep(0.05)
    assert settled == [result.held] and td.held_pages == 0
    d.scheduler.blocks.free(settled.pop())  # what KVExchange does with them
    assert d.pool.num_free == free and d.cache.cached_len(tokens) == 0
    received, result = take(Handoff(d.scheduler.blocks), tokens, offer, reader(td, peer))
    assert result.ok and received == offer["tokens"]
    assert d.generate([tokens], GREEDY) == [aggregated]
    assert handoff.release("r")
    all_pages_back(p)
    all_pages_back(d)


def test_engines_whose_ranks_differ_are_refused_by_name(tp_pair):
    ref, _, _, td, _, _ = tp_pair
    one = KVTransport("one-rank", ref.pool)
    try:
        with pytest.raises(ValueError, match="tensor_parallel_size differs: 2 here, 1 there"):
            td.connect(one.offer())
        with pytest.raises(ValueError, match="tensor_parallel_size differs: 1 here, 2 there"):
            one.connect(td.offer())
    finally:
        one.close()
