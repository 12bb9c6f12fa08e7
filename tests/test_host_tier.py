"""The host tier under the radix cache: pages the device evicts move to host memory and
come back for the next request that matches them, with the same tokens as
transformers; the router mirrors both tiers exactly; a failed copy loses nothing."""

from __future__ import annotations

import time

import pytest
import torch
from conftest import assert_cached_kids_counted, make_request, random_prompts
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

# The parity suite, run again below with every engine on a host tier (``make_engine``).
from test_parity import (  # noqa: F401
    expected,
    test_concurrent_requests_share_a_prefix_computed_in_the_same_run,
    test_eight_concurrent_mixed_lengths,
    test_logprobs_are_the_models_own,
    test_one_request,
    test_penalties_match_a_reference_loop_over_transformers,
    test_shared_long_prefix_hits_cache,
    test_small_pool_forces_eviction_and_preemption,
    vocab,
)
from test_radix_cache import chunked_prefill, token_lists, walk

from preble_backend.common.block_hash import chain_hashes
from preble_backend.engine.cache import host_tier
from preble_backend.engine.cache.host_tier import HostTier
from preble_backend.engine.cache.radix_cache import RadixCache
from preble_backend.engine.config import EngineConfig
from preble_backend.engine.scheduling.block_manager import BlockManager
from preble_backend.model.kv_pool import KVPool
from scheduler.global_tree import GlobalPrefixTree

GREEDY = {"temperature": 0}
PAGE, DEVICE_PAGES, HOST_PAGES = 4, 24, 12


@pytest.fixture
def make_engine(make_engine):
    """Every engine with a host tier, whose device cache moves down to it whole before
    each ``generate``: a prefix an earlier call computed comes back through the host
    tier (the parity suite's exact cache counts hold, loaded pages counting as cached)."""

    def build(model_path: str, **overrides):
        engine = make_engine(model_path, **{"max_num_tokens": 512, "host_kv_tokens": 4096, **overrides})
        run = engine.generate

        def generate(prompts, params=None):
            engine.pool.free(engine.cache.evict(engine.cache.num_evictable_pages))
            return run(prompts, params)

        engine.generate = generate
        return engine

    return build


# ---- the cache's tiers under any sequence of operations ---------------------------------------


def pool(num_pages: int) -> KVPool:
    return KVPool(num_pages, PAGE, num_layers=1, num_kv_heads=1, head_dim=1, dtype=torch.float32)


def content(p: KVPool, page: int) -> tuple[int, ...]:
    """What a page holds: the tests write each slot's token into its K and V."""
    k = p.k_cache[0, page * PAGE : (page + 1) * PAGE, 0, 0]
    v = p.v_cache[0, page * PAGE : (page + 1) * PAGE, 0, 0]
    assert torch.equal(k, v)
    return tuple(int(t) for t in k)


class TieredCacheMachine(RuleBasedStateMachine):
    """The radix cache over a device pool and a host tier half its size: every page of
    either tier holds exactly the tokens of its place in the tree (copies move real
    data), every page of either pool has one owner, and the events rebuild both tiers."""

    def __init__(self) -> None:
        super().__init__()
        self.device, self.host = pool(DEVICE_PAGES), pool(HOST_PAGES)
        self.cache = RadixCache(PAGE, HostTier(self.device, self.host))
        self.blocks = BlockManager(self.device, self.cache)
        self.held = []
        self.mirror = GlobalPrefixTree(1, page_size=PAGE)
        self.next_id = 0

    @rule(tokens=token_lists, chunk=st.integers(1, 3))
    def admit_and_compute(self, tokens, chunk):
        req = make_request(tokens, self.next_id)
        self.next_id += 1
        cached = self.blocks.admit(req)  # loads back what the host holds of it
        assert cached == len(req.page_table) * PAGE and cached < len(tokens)
        for i, page in enumerate(req.page_table):
            assert content(self.device, page) == tuple(tokens[i * PAGE : (i + 1) * PAGE])
        done = chunked_prefill(self.blocks, req, chunk)
        for i, page in enumerate(req.page_table):  # "compute" the KV: write each token
            span = torch.tensor(tokens[i * PAGE : (i + 1) * PAGE] + [-1] * PAGE, dtype=torch.float32)[:PAGE]
            self.device.k_cache[0, page * PAGE : (page + 1) * PAGE, 0, 0] = span
            self.device.v_cache[0, page * PAGE : (page + 1) * PAGE, 0, 0] = span
        if not done:
            self.blocks.release(req)
            return
        self.held.append(req)

    @precondition(lambda self: self.held)
    @rule(data=st.data())
    def release(self, data):
        self.blocks.release(self.held.pop(data.draw(st.integers(0, len(self.held) - 1))))

    @rule(n=st.integers(0, DEVICE_PAGES), offload=st.booleans())
    def evict(self, n, offload):
        evictable = self.cache.num_evictable_pages
        freed = self.cache.evict(n, offload)
        assert len(freed) >= min(n, evictable)
        self.device.free(freed)

    @rule(window=st.integers(0, DEVICE_PAGES))
    def copy_ahead(self, window):
        """Copies ahead of eviction take no room from other copies, and copy nothing at
        eviction time."""
        kept = sum(len(n.host_copy) for n in self.cache.copies)
        offloaded = self.cache.host.stats.pages_offloaded
        copied = self.cache.copy_ahead(window)
        assert copied <= window
        assert sum(len(n.host_copy) for n in self.cache.copies) == kept + copied
        assert self.cache.host.stats.pages_offloaded == offloaded

    @rule(n=st.integers(0, HOST_PAGES))
    def evict_host(self, n):
        before = self.cache.num_host_pages
        assert self.cache.evict_host(n) >= min(n, before)

    @invariant()
    def tiers(self):
        nodes = list(walk(self.cache.root))
        for node in nodes:
            assert len(node.key) == len(node.pages) * PAGE > 0
            assert node.parent.children[tuple(node.key[:PAGE])] is node
            assert not node.parent.on_host or node.on_host  # the device's pages come first
            assert node.lock_ref == 0 or not node.on_host
            path = node.path_tokens()
            start = len(path) - len(node.key)
            assert not node.host_copy or (len(node.host_copy) == len(node.pages) and not node.on_host)
            store = self.host if node.on_host else self.device
            for i, page in enumerate(node.pages):
                assert content(store, page) == tuple(path[start + i * PAGE : start + (i + 1) * PAGE])
            for i, page in enumerate(node.host_copy):
                assert content(self.host, page) == tuple(path[start + i * PAGE : start + (i + 1) * PAGE])
            assert node.path_hashes() == chain_hashes(path, PAGE)  # what its events name
        device = [n for n in nodes if not n.on_host]
        assert self.cache.leaves == {n for n in device if not n.has_device_child()}
        assert self.cache.host_leaves == {n for n in nodes if n.on_host and not n.children}
        assert self.cache.copies == {n for n in device if n.host_copy}
        assert self.cache.num_pages == sum(len(n.pages) for n in device)
        assert self.cache.num_host_pages == len(host_pages(nodes))
        assert self.cache.num_locked_pages == sum(len(n.pages) for n in device if n.lock_ref > 0)

    @invariant()
    def every_page_has_one_owner(self):
        nodes = list(walk(self.cache.root))
        private = [p for r in self.held for p in r.page_table[r.num_tree_pages :]]
        device = self.device._free + [p for n in nodes if not n.on_host for p in n.pages] + private
        assert sorted(device) == list(range(DEVICE_PAGES))
        assert sorted(self.host._free + host_pages(nodes)) == list(range(HOST_PAGES))

    @rule()
    def events_mirror_both_tiers(self):
        self.mirror.apply_events(0, self.cache.drain_events())
        assert_cached_kids_counted(self.mirror)
        device = {tuple(chain_hashes(leaf.path_tokens(), PAGE)) for leaf in self.cache.leaves}
        assert self.mirror.cached_sequences(0) == device
        hosted = hosted_hashes(self.cache, PAGE)
        assert self.mirror.host.pages[0] == hosted and self.mirror.host.total == len(hosted)

    def teardown(self):
        self.events_mirror_both_tiers()
        snapshot = GlobalPrefixTree(1, page_size=PAGE)  # a new reader rebuilds both from one
        snapshot.apply_events(0, self.cache.snapshot())
        assert snapshot.cached_sequences(0) == self.mirror.cached_sequences(0)
        assert snapshot.host.pages[0] == self.mirror.host.pages[0]
        for req in self.held:
            self.blocks.release(req)
        self.device.free(self.cache.reset())
        assert self.device.num_free == DEVICE_PAGES and self.host.num_free == HOST_PAGES
        self.mirror.apply_events(0, self.cache.drain_events())
        assert self.mirror.cached_sequences(0) == set() and not self.mirror.host.pages[0]


def host_pages(nodes: list) -> list[int]:
    """The host pool's pages the tree holds: host nodes' pages and device nodes' copies."""
    return [p for n in nodes for p in (n.pages if n.on_host else n.host_copy)]


TestTieredCacheMachine = TieredCacheMachine.TestCase
TestTieredCacheMachine.settings = settings(max_examples=400, stateful_step_count=40, deadline=None)


# ---- the engine --------------------------------------------------------------------------------


def push_out(engine, model_path: str, seed: int) -> None:
    """Fill the device pool with an unrelated prompt, so the cached prefixes move down."""
    [filler] = random_prompts([496], vocab(model_path), seed=seed)  # 32 of the 32 pages
    engine.generate([filler], {**GREEDY, "max_tokens": 2})


def turns_pushed_out(engine, model_path: str) -> tuple[list[list[int]], list]:
    """Three prompts sharing a 240-token prefix, each answered (8 greedy tokens) and then
    pushed out of the device by a filler; after each, the router's mirror of the host
    tier equals the engine's. The prompts and their answers."""
    [prefix] = random_prompts([240], vocab(model_path), seed=21)
    prompts = [prefix + s for s in random_prompts([7, 30, 1], vocab(model_path), seed=22)]
    mirror = GlobalPrefixTree(1, page_size=16)
    cursor, out = engine.cache_events(None).cursor, []
    for i, prompt in enumerate(prompts):
        out += engine.generate([prompt], {**GREEDY, "max_tokens": 8})
        push_out(engine, model_path, seed=30 + i)
        batch = engine.cache_events(cursor)
        mirror.apply_events(0, batch.events)
        cursor = batch.cursor
        assert mirror.host.pages[0] == hosted_hashes(engine.cache, 16)
    return prompts, out


def test_a_prefix_pushed_to_the_host_comes_back_with_the_same_tokens(any_model, make_engine, hf_reference):
    engine = make_engine(any_model, page_size=16, chunk_size=64)
    prompts, out = turns_pushed_out(engine, any_model)
    assert out == expected(hf_reference, any_model, prompts, 8)
    stats = engine.stats()
    assert stats["host_loadbacks"] == 2 and stats["host_pages_loaded"] == 2 * (240 // 16)
    assert stats["prompt_tokens_cached"] >= 2 * 240 - 2 * 16  # the loaded pages count as cached


def hosted_hashes(cache: RadixCache, page: int) -> set[int]:
    """What the host pool holds, by chain hash: host nodes and device nodes' copies."""
    out = set()
    for node in walk(cache.root):
        if node.on_host or node.host_copy:
            path = node.path_tokens()
            out.update(chain_hashes(path, page)[(len(path) - len(node.key)) // page :])
    return out


def test_a_full_host_tier_evicts_its_oldest_pages(tiny_model, make_engine, hf_reference):
    """A host tier of 8 pages under much more traffic: it drops by LRU and never
    blocks; the newest prefix is still loaded back."""
    engine = make_engine(tiny_model, page_size=16, chunk_size=64, max_num_tokens=512, host_kv_tokens=128)
    prompts = random_prompts([300, 300, 300], vocab(tiny_model), seed=23)
    out = engine.generate(prompts, {**GREEDY, "max_tokens": 4})
    last = prompts[-1][:120] + [5, 6, 7]
    push_out(engine, tiny_model, seed=24)
    out += engine.generate([last], {**GREEDY, "max_tokens": 4})
    assert out == expected(hf_reference, tiny_model, prompts + [last], 4)
    stats = engine.stats()
    assert stats["kv_host_pages_used"] <= 8 and stats["host_pages_offloaded"] > 8


@pytest.mark.parametrize("failing", ["offload", "load", "slow"])
def test_a_failed_or_slow_copy_loses_nothing(tiny_model, make_engine, hf_reference, monkeypatch, failing):
    """Copies between tiers that raise: the pages are dropped (offload) or recomputed
    (load-back), every page of both pools comes back, and the tokens are unchanged. Copies
    that take 50 ms each: the engine waits for them, and the tokens are unchanged."""
    real = host_tier.copy_pages

    def flaky(src, src_pages, dst, dst_pages):
        if failing == "slow":
            time.sleep(0.05)
        elif (dst is engine.cache.host.pool) == (failing == "offload"):
            raise RuntimeError("injected copy failure")
        real(src, src_pages, dst, dst_pages)

    engine = make_engine(tiny_model, page_size=16, chunk_size=64)
    monkeypatch.setattr(host_tier, "copy_pages", flaky)
    [prefix] = random_prompts([200], vocab(tiny_model), seed=25)
    prompts = [prefix + [9], prefix + [10, 11]]
    out = engine.generate(prompts[:1], {**GREEDY, "max_tokens": 6})
    push_out(engine, tiny_model, seed=26)
    out += engine.generate(prompts[1:], {**GREEDY, "max_tokens": 6})
    assert out == expected(hf_reference, tiny_model, prompts, 6)
    stats = engine.stats()
    if failing == "slow":
        assert stats["host_copy_failures"] == 0 and stats["host_loadbacks"] == 1
    else:
        assert stats["host_copy_failures"] > 0 and stats["host_loadbacks"] == 0


def test_without_a_tier_nothing_moves(tiny_model, make_engine):
    engine = make_engine(tiny_model, page_size=16, host_kv_tokens=0)
    push_out(engine, tiny_model, seed=27)
    assert engine.cache.host is None and "host_loadbacks" not in engine.stats()
    assert all(e.tier == "device" for e in engine.cache_events(None).events)


def test_host_tier_settings_are_checked():
    with pytest.raises(ValueError, match="host_kv_tokens=8 is invalid"):
        EngineConfig("tiny", page_size=16, host_kv_tokens=8)
    with pytest.raises(ValueError, match="tensor_parallel_size > 1"):
        EngineConfig("tiny", host_kv_ratio=2.0, tensor_parallel_size=2)
    assert EngineConfig("tiny", page_size=16, host_kv_ratio=3.0).host_pages(10) == 30


# ---- served ---------------------------------------------------------------------------------------


@pytest.mark.server  # a real tritonserver
def test_served_engines_load_back_from_the_host_tier(tmp_path, capsys):
    """``preble repo --host-kv-tokens`` writes the engines' parameter; served by
    tritonserver behind the router, a document pushed out of a 1,024-token device pool by
    two others comes back from the host tier with the same answer, and the engine's
    metrics count the load-back and the pages copied down ahead of eviction, beside the
    fillers' passes, that then went down with no copy; pushed out again, it goes down
    without a copy again (the host kept its pages), and the metrics count those too."""
    import json

    from server_utils import http, metric_value, serve_stack, write_test_repository

    from preble_backend.cli import main
    from preble_backend.serving.pbtxt import config_parameter

    assert main(["repo", str(tmp_path / "r"), "--cpu-engines", "1", "--host-kv-tokens", "4096"]) == 0
    text = (tmp_path / "r" / "preble_engine_0" / "config.pbtxt").read_text()
    assert config_parameter(text, "host_kv_tokens") == "4096"
    assert config_parameter(text, "host_copy_ahead") == "true"

    repo = write_test_repository(tmp_path / "repo", cpu_engines=1, max_num_tokens=1024, host_kv_tokens=4096)
    stack = serve_stack(repo)
    try:
        sampling = json.dumps({"max_tokens": 8, "temperature": 0, "ignore_eos": True})

        def generate(prompt: str) -> str:
            body = json.dumps({"text_input": prompt, "sampling_parameters": sampling}).encode()
            status, _, answer = http("POST", stack.url("/v2/models/preble/generate"), body)
            assert status == 200, answer
            return json.loads(answer)["text_output"]

        doc = " ".join(f"clause {i} of the shared contract says" for i in range(25))  # ~425 tokens
        first = generate(doc + " What does clause 3 say?")

        def push_down(fillers: range) -> None:  # ~480 tokens each: two push the document down
            for k in fillers:
                generate(" ".join(f"unrelated filler {k} sentence number {i} here" for i in range(30)))

        push_down(range(2))
        again = generate(doc + " What does clause 3 say?")
        assert again == first
        metrics = stack.url("", stack.ports.metrics)
        assert metric_value(metrics, "preble_engine_host_loadbacks_total") == 1
        assert metric_value(metrics, "preble_engine_host_pages_loaded_total") >= 400 // 16
        assert metric_value(metrics, "preble_engine_host_pages_copied_ahead_total") > 0
        reused = metric_value(metrics, "preble_engine_host_pages_reused_total")
        assert reused > 0
        push_down(range(2, 4))
        assert metric_value(metrics, "preble_engine_host_pages_reused_total") > reused
    finally:
        stack.stop()
