"""A prompt's KV handed from a prefill engine to a decode engine through NIXL, two real
engines (the embedded tiny model, fp32) in one process: the decode side's answers equal
the aggregated ones, only what it lacks moves, and a failed handoff leaves every page
where it was and still answers the same."""

from __future__ import annotations

import pytest

from preble_backend.engine.config import EngineConfig
from preble_backend.engine.engine import Engine
from preble_backend.engine.scheduling.handoff import Handoff
from preble_backend.kv_transfer.nixl_transport import KVTransport, TransferResult

GREEDY = {"temperature": 0, "max_tokens": 12}
SEEDED = {"temperature": 0.8, "seed": 3, "max_tokens": 12}


def take(handoff: Handoff, tokens: list[int], offer: dict, read) -> tuple[int, TransferResult | None]:
    """The decode side's reserve, read and commit in one thread (the engine server runs the
    read on a thread of its own): (tokens received, the read's result; None when nothing
    had to move or no room could be made)."""
    claim = handoff.reserve(tokens, offer)
    if claim is None:
        return 0, None
    result = read(claim.remote, claim.stamps, claim.new)
    return handoff.commit(claim, result), result


@pytest.fixture(scope="module")
def pair(tiny_model):
    """(prefill engine, decode engine, a read from the prefill engine's pool into the
    decode engine's)."""
    p, d = (Engine(EngineConfig(model_path=tiny_model, max_num_tokens=4096)) for _ in range(2))
    tp, td = KVTransport("prefill", p.pool), KVTransport("decode", d.pool)
    peer = td.connect(tp.offer())
    yield p, d, lambda remote, stamps, local: td.read(peer, remote, stamps, local)
    td.close()
    tp.close()


def prompt(seed: int, n: int = 150) -> list[int]:
    return [(seed * 7919 + i * 104729) % 1900 + 50 for i in range(n)]


def all_pages_back(engine: Engine) -> None:
    assert not engine.scheduler.running and not engine.scheduler.waiting
    assert engine.pool.num_free + engine.cache.num_pages == engine.pool.num_pages
    assert engine.cache.num_locked_pages == 0


@pytest.mark.parametrize("params", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_the_decode_side_answers_as_the_prefill_side_would(pair, params):
    p, d, read = pair
    tokens = prompt(1 if params is GREEDY else 2)
    [aggregated] = p.generate([tokens], params)  # the prefill side computes and caches it
    ps = p.pool.page_size
    handoff = Handoff(p.scheduler.blocks)
    offer = handoff.offer("r", tokens)
    assert offer["tokens"] == len(tokens) // ps * ps and len(offer["pages"]) == len(tokens) // ps
    received, result = take(Handoff(d.scheduler.blocks), tokens, offer, read)
    assert result.ok and received == offer["tokens"]
    assert d.cache.cached_len(tokens) == offer["tokens"]
    before = d.scheduler.stats.prompt_tokens_cached
    assert d.generate([tokens], params) == [aggregated]
    assert d.scheduler.stats.prompt_tokens_cached - before == offer["tokens"]  # only the last page computed
    assert handoff.release("r")
    all_pages_back(p)
    all_pages_back(d)


def test_only_the_pages_the_decode_side_lacks_move(pair):
    """The decode side already answered a prompt sharing the first 64 tokens (4 pages):
    those stay, the other 5 whole pages move."""
    p, d, read = pair
    tokens = prompt(3)
    d.generate([tokens[:64] + prompt(4, 40)], GREEDY)
    [aggregated] = p.generate([tokens], GREEDY)
    handoff = Handoff(p.scheduler.blocks)
    offer = handoff.offer("r", tokens)
    received, result = take(Handoff(d.scheduler.blocks), tokens, offer, read)
    assert result.ok and result.pages == len(offer["pages"]) - 4 and received == offer["tokens"] - 64
    assert d.generate([tokens], GREEDY) == [aggregated]
    assert handoff.release("r") and not handoff.release("r")
    all_pages_back(p)
    all_pages_back(d)


def test_a_page_freed_after_the_offer_is_never_decoded_from(pair):
    """The forced race: the lease ends and the prefill side evicts the prompt before the
    decode side reads. The read is stale, the decode side keeps none of its new pages,
    prefills the prompt itself and answers the same."""
    p, d, read = pair
    tokens = prompt(5)
    [aggregated] = p.generate([tokens], GREEDY)
    handoff = Handoff(p.scheduler.blocks, ttl_s=0.0)
    offer = handoff.offer("r", tokens)
    assert handoff.expire() == 1 and p.cache.num_locked_pages == 0
    p.scheduler.blocks.free(p.cache.evict(p.cache.num_evictable_pages))
    a_stale_read_prefills_here(p, d, read, tokens, offer, aggregated)


def a_stale_read_prefills_here(p: Engine, d: Engine, read, tokens: list[int], offer: dict,
                               aggregated: list[int]) -> None:  # fmt: skip
    """``offer``'s pages were freed on ``p``: the read is stale, ``d`` keeps none of its new
    pages, prefills the prompt itself and answers ``aggregated``; every page is back."""
    free = d.pool.num_free
    received, result = take(Handoff(d.scheduler.blocks), tokens, offer, read)
    assert received == 0 and not result.ok and result.stale == offer["pages"]
    assert d.pool.num_free == free and d.cache.cached_len(tokens) == 0
    assert d.generate([tokens], GREEDY) == [aggregated]
    all_pages_back(p)
    all_pages_back(d)


def test_engines_with_sliding_windows_are_refused(pair):
    p, _, _ = pair
    blocks = p.scheduler.blocks
    blocks.pool.window, saved = object(), blocks.pool.window
    try:
        with pytest.raises(ValueError, match="sliding-window"):
            Handoff(blocks)
    finally:
        blocks.pool.window = saved


def test_pages_a_late_read_may_still_write_stay_out_of_use_until_it_has_ended(pair):
    """A read that timed out with its handles in flight holds its pages (the transport says
    which, ``TransferResult.held``): the commit frees the others; the held ones come back
    only when the transport hands them back, and then every page is back."""
    p, d, _ = pair
    tokens = prompt(7)
    p.generate([tokens], GREEDY)
    lender = Handoff(p.scheduler.blocks, ttl_s=0.0)
    offer = lender.offer("late", tokens)
    free = d.pool.num_free
    claim = Handoff(d.scheduler.blocks).reserve(tokens, offer)
    late = TransferResult(False, len(claim.new), 0, 1.0, 0, [], "the transfer did not finish in time",
                          held=list(claim.new))  # fmt: skip
    assert Handoff(d.scheduler.blocks).commit(claim, late) == 0
    assert d.pool.num_free == free - len(claim.new)  # held: nobody can be given them
    d.scheduler.blocks.free(late.held)  # what KVExchange does when the transport settles them
    assert d.pool.num_free == free and d.cache.cached_len(tokens) == 0
    assert lender.expire() == 1
    all_pages_back(p)
    all_pages_back(d)


@pytest.fixture(scope="module")
def tiered_pair(tiny_model):
    """``pair`` with a host tier on each engine."""
    config = EngineConfig(model_path=tiny_model, max_num_tokens=1024, host_kv_tokens=4096)
    p, d = Engine(config), Engine(config)
    tp, td = KVTransport("prefill-tiered", p.pool), KVTransport("decode-tiered", d.pool)
    peer = td.connect(tp.offer())
    yield p, d, lambda remote, stamps, local: td.read(peer, remote, stamps, local)
    td.close()
    tp.close()


def to_host(engine: Engine) -> None:
    """Evict every unlocked device page: the host tier keeps what it held."""
    engine.scheduler.blocks.free(engine.cache.evict(engine.cache.num_evictable_pages))


@pytest.mark.parametrize("params", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_a_prefix_in_the_host_tier_answers_as_aggregated(pair, tiered_pair, params):
    """Host tiers on both sides: the prefill side's shared first 64 tokens come back from
    its host tier for the prefill; the decode side holds them on its host only, so every
    whole page is read from the prefill side and becomes its host node's device copy. The
    answer is the untiered engine's, and every device and host page is back."""
    ref, _, _ = pair
    p, d, read = tiered_pair
    tokens = prompt(11 if params is GREEDY else 12)
    [aggregated] = ref.generate([tokens], params)
    for engine in (p, d):
        engine.generate([tokens[:64] + prompt(13, 40)], GREEDY)
        to_host(engine)
        assert not engine.cache.match_prefix(tokens)[0] and engine.cache.cached_len(tokens) == 64  # on host
    loaded = p.cache.host.stats.pages_loaded
    assert p.generate([tokens], params) == [aggregated]
    assert p.cache.host.stats.pages_loaded - loaded == 4  # the shared prefix came back up
    handoff = Handoff(p.scheduler.blocks)
    offer = handoff.offer("r", tokens)
    ps = p.pool.page_size
    received, result = take(Handoff(d.scheduler.blocks), tokens, offer, read)
    assert result.ok and result.pages == len(tokens) // ps and received == offer["tokens"]
    before = d.scheduler.stats.prompt_tokens_cached
    assert d.generate([tokens], params) == [aggregated]
    assert d.scheduler.stats.prompt_tokens_cached - before == offer["tokens"]
    assert handoff.release("r")
    for engine in (p, d):
        all_pages_back(engine)
        assert engine.cache.host.pool.num_used == engine.cache.num_host_pages
        to_host(engine)  # the next case starts with nothing on the devices
