"""Page chain hashes and what the global tree builds on them: the prefix property, the
engines' reports on the wire, and the virtual LRU eviction behind M, checked against a
brute-force eviction computed here."""

from __future__ import annotations

import logging
import random

import numpy as np
import pytest
from conftest import assert_cached_kids_counted

from preble_backend.common.block_hash import chain_hashes, finalized, page_sums
from preble_backend.common.cache_event import CacheEvent, EventBatch
from preble_backend.common.cost_model import CostModel
from preble_backend.common.sampling_params import SamplingParams
from preble_backend.serving.protocol import decode_report, encode_report
from scheduler.e2 import E2
from scheduler.global_tree import GlobalPrefixTree
from scheduler.load_cost import memory_cost
from scheduler.policy import FinishInfo, InstanceLoad, RoutingRequest
from scheduler.tree_node import Match

UNIT = CostModel(base_ms=0, prefill_ms_per_token=1, decode_ms_per_request=0,
                 attention_ms_per_context_token=0, decode_step_ms=1)  # fmt: skip


@pytest.mark.parametrize("page_size", [1, 4, 16])
def test_chain_values_are_equal_exactly_while_the_pages_are(page_size):
    rng = random.Random(page_size)
    for _ in range(50):
        a = [rng.randrange(50_000) for _ in range(rng.randrange(0, 200))]
        cut = rng.randrange(0, len(a) + 1)
        b = a[:cut] + [rng.randrange(50_000) for _ in range(rng.randrange(0, 100))]
        ha, hb = chain_hashes(a, page_size), chain_hashes(b, page_size)
        assert len(ha) == len(a) // page_size  # a partial last page has no value
        same = next((k for k in range(min(len(a), len(b))) if a[k] != b[k]), min(len(a), len(b)))
        for k in range(min(len(ha), len(hb))):
            assert (ha[k] == hb[k]) == ((k + 1) * page_size <= same)
        assert chain_hashes(np.asarray(a, dtype=np.int64), page_size) == ha  # arrays as lists


@pytest.mark.parametrize("page_size", [1, 4, 16])
def test_sums_continued_from_a_prefix_are_the_whole_prompts_chain_hashes(page_size):
    """A radix node added below another hashes only its own tokens, from where its parent
    ends and that parent's last sum: the chain hashes must be the whole path's."""
    rng = random.Random(page_size)
    for _ in range(50):
        tokens = [rng.randrange(50_000) for _ in range(rng.randrange(0, 300))]
        cut = rng.randrange(0, len(tokens) // page_size + 1) * page_size
        head = page_sums(tokens[:cut], page_size)
        tail = page_sums(tokens[cut:], page_size, cut, head[-1] if head else 0)
        assert finalized(head + tail) == chain_hashes(tokens, page_size)


@pytest.mark.parametrize("page_size", [1, 4, 16])
def test_runs_of_one_token_name_each_prefix_apart(page_size):
    """Repeated tokens, 0 among them (a run of token 0 once hashed to 0 at every length):
    every page of a run has its own value, and runs of different tokens share none."""
    seen: dict[int, tuple[int, int]] = {}
    for token in (0, 1, 2, 255, 50_000, 2**31 - 1):
        hashes = chain_hashes([token] * (page_size * 20), page_size)
        for k, h in enumerate(hashes):
            assert seen.setdefault(h, (token, k)) == (token, k)


def test_cache_events_travel_as_hashes():
    events = [
        CacheEvent.of("stored", list(range(40)), 16, 16),
        CacheEvent.of("evicted", list(range(32)), 0, 16),
    ]
    batch, load = decode_report(encode_report({"kv_pages_total": 8}, EventBatch("L", 0, 2, events)))
    assert batch.events == events and load == {"kv_pages_total": 8}
    assert events[0].start == 1 and events[0].hashes == tuple(chain_hashes(range(40), 16))


def brute_force_memory_cost(
    tree: GlobalPrefixTree, instance: int, match: Match, need: int, now: float
) -> float:
    """LRU leaf eviction as an engine does it: the oldest evictable leaf first, a parent
    joining once its last held child is gone; nodes on the matched path and nodes requests
    still running there hold, never."""
    held = list(tree.lru[instance])
    age = {node: k for k, node in enumerate(held)}
    gone: set = set()
    freed = spent = 0
    while freed < need:
        leaves = [
            n for n in held
            if n not in gone and n not in match.nodes and instance not in n.pending
            and not any(c.held_by(instance) and c not in gone for c in n.children.values())
        ]  # fmt: skip
        if not leaves:
            break
        node = min(leaves, key=age.__getitem__)
        gone.add(node)
        tokens = node.held_pages(instance) * tree.page_size
        freed += tokens
        spent += tokens * tree.requests_in_window(node, instance, now)
    return spent


@pytest.mark.parametrize("seed", range(3))
def test_virtual_eviction_matches_a_brute_force_lru_eviction(seed):
    """M, asked after every kind of change the tree sees, is the brute-force LRU answer."""
    rng = random.Random(seed)
    tree = GlobalPrefixTree(2, window_s=50.0, page_size=1)
    prompts = [[rng.randrange(4) for _ in range(rng.randrange(1, 4))] + list(range(100 * k, 100 * k + 20))
               for k in range(40)]  # fmt: skip
    in_flight = []
    for step in range(200):
        now = float(step)
        prompt = rng.choice(prompts)[: rng.randrange(5, 24)]
        instance = rng.randrange(2)
        in_flight.append((tree.route(chain_hashes(prompt, 1), instance, now), instance, prompt))
        # Most finish at once, some later; each caches its prompt and the pages it wrote.
        for k in [-1] * (rng.random() < 0.6) + [0] * (len(in_flight) > 1 and rng.random() < 0.3):
            end, instance, prompt = in_flight.pop(k)
            output = prompt + [rng.randrange(1000, 1003) for _ in range(rng.randrange(3))]
            tree.apply_events(instance, [CacheEvent("stored", tuple(chain_hashes(output, 1)), 0)])
            tree.finish(end, instance)
        if rng.random() < 0.3:  # an engine drops the tail of something it cached
            tail = chain_hashes(rng.choice(prompts)[: rng.randrange(5, 24)], 1)
            tree.apply_events(
                rng.randrange(2), [CacheEvent("evicted", tuple(tail), rng.randrange(len(tail)))]
            )
        for _ in range(3):
            probe = tree.match(chain_hashes(rng.choice(prompts), 1))
            need = rng.randrange(1, 200)
            expected = brute_force_memory_cost(tree, 0, probe, need, now)
            assert memory_cost(tree, 0, need, probe, now, UNIT) == expected
        if step % 25 == 0:
            tree.prune(now)
            assert_cached_kids_counted(tree)


def test_e2_names_a_page_size_other_than_the_engines(caplog):
    policy = E2(2, cost_model=UNIT, page_size=16)
    request = RoutingRequest("r", list(range(40)), SamplingParams())
    decision = policy.select(request, [InstanceLoad(), InstanceLoad()])
    with caplog.at_level(logging.ERROR, logger="preble.e2"):
        policy.on_finish(decision.instance, request, FinishInfo([], {"kv_pages_total": 64, "page_size": 32}))
    assert "reports KV pages of 32 tokens but E2 hashes prompts per 16" in caplog.text
