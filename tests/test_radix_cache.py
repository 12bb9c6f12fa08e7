"""The radix cache and block manager keep their invariants under any sequence of
admissions, releases, matches and evictions (property-based), plus hand-made cases."""

from __future__ import annotations

from conftest import assert_cached_kids_counted, make_request, tiny_pool
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from preble_backend.common.block_hash import chain_hashes
from preble_backend.common.cache_event import CacheEvent
from preble_backend.engine.cache.radix_cache import RadixCache
from preble_backend.engine.scheduling.block_manager import BlockManager
from preble_backend.engine.scheduling.request import Request
from scheduler.global_tree import GlobalPrefixTree

PAGE = 4
NUM_PAGES = 24  # tiny_pool's defaults


def walk(node):
    for child in node.children.values():
        yield child
        yield from walk(child)


# A small alphabet and shared stems make prefixes collide often.
token_lists = st.one_of(
    st.lists(st.integers(0, 2), min_size=1, max_size=30),
    st.tuples(
        st.sampled_from([[1, 2, 3, 4, 5, 6, 7, 8], [1, 2, 3, 4, 9, 9]]),
        st.lists(st.integers(0, 3), max_size=12),
    ).map(lambda t: t[0] + t[1]),
)


def chunked_prefill(blocks: BlockManager, req: Request, chunk_pages: int) -> bool:
    """Compute an admitted request chunk by chunk as the engine does: reserve pages for
    each chunk (evicting when the pool runs dry), then share its full pages, so stores
    and evictions interleave. False when the pool cannot hold the next chunk."""
    while req.num_computed < req.num_tokens:
        step = min(chunk_pages * blocks.page_size, req.num_tokens - req.num_computed)
        if not blocks.reserve(req, step):
            return False
        req.num_computed += step
        blocks.share_computed(req)
    return True


class CacheMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.pool = tiny_pool()
        self.cache = RadixCache(PAGE)
        self.blocks = BlockManager(self.pool, self.cache)
        self.held: list[Request] = []
        self.content: dict[int, tuple[int, ...]] = {}  # what each page "stores"
        self.mirror = GlobalPrefixTree(1, page_size=PAGE)  # fed only by the cache's events
        self.next_id = 0

    @rule(tokens=token_lists, chunk=st.integers(1, 3))
    def admit_and_compute(self, tokens, chunk):
        req = make_request(tokens, self.next_id)
        self.next_id += 1
        cached = self.blocks.admit(req)
        assert cached % PAGE == 0 and cached < len(tokens)
        assert cached == len(req.page_table) * PAGE
        done = chunked_prefill(self.blocks, req, chunk)
        for i, page in enumerate(req.page_table):  # what each page now "stores"
            self.content[page] = tuple(tokens[i * PAGE : (i + 1) * PAGE])
        if not done:
            self.blocks.release(req)
            return
        self.held.append(req)

    @precondition(lambda self: self.held)
    @rule(data=st.data())
    def release(self, data):
        req = self.held.pop(data.draw(st.integers(0, len(self.held) - 1)))
        self.blocks.release(req)

    @rule(n=st.integers(0, NUM_PAGES))
    def evict(self, n):
        evictable = self.cache.num_evictable_pages
        freed = self.cache.evict(n)
        assert len(freed) >= min(n, evictable)
        self.pool.free(freed)

    @rule(tokens=token_lists)
    def match(self, tokens):
        n = self.cache.cached_len(tokens)
        pages, node = self.cache.match_prefix(tokens)
        assert len(pages) * PAGE == n
        assert node.path_tokens() == tokens[:n]
        for i, page in enumerate(pages):
            assert self.content[page] == tuple(tokens[i * PAGE : (i + 1) * PAGE])

    @invariant()
    def structure(self):
        nodes = list(walk(self.cache.root))
        for node in nodes:
            assert len(node.key) == len(node.pages) * PAGE > 0
            assert node.parent.children[tuple(node.key[:PAGE])] is node
            path = node.path_tokens()
            start = len(path) - len(node.key)
            for i, page in enumerate(node.pages):
                assert self.content[page] == tuple(path[start + i * PAGE : start + (i + 1) * PAGE])
            assert node.path_hashes() == chain_hashes(path, PAGE)  # what its events name
        assert self.cache.leaves == {n for n in nodes if not n.children}
        assert self.cache.num_pages == sum(len(n.pages) for n in nodes)
        assert self.cache.num_locked_pages == sum(len(n.pages) for n in nodes if n.lock_ref > 0)

    @rule()
    def events_mirror_the_cache(self):
        """Drained after any number of steps, the coalesced events still rebuild the cache."""
        self.mirror.apply_events(0, self.cache.drain_events())
        assert_cached_kids_counted(self.mirror)
        engine = {tuple(chain_hashes(leaf.path_tokens(), PAGE)) for leaf in self.cache.leaves}
        assert self.mirror.cached_sequences(0) == engine

    @invariant()
    def references(self):
        expected: dict[int, int] = {}
        for req in self.held:
            node = req.cache_node
            while node is not self.cache.root:
                expected[id(node)] = expected.get(id(node), 0) + 1
                node = node.parent
        for node in walk(self.cache.root):
            assert node.lock_ref == expected.get(id(node), 0)

    @invariant()
    def every_page_has_one_owner(self):
        tree = [p for n in walk(self.cache.root) for p in n.pages]
        private = [p for r in self.held for p in r.page_table[r.num_tree_pages :]]
        owned = self.pool._free + tree + private
        assert sorted(owned) == list(range(NUM_PAGES))

    def teardown(self):
        self.events_mirror_the_cache()
        for req in self.held:
            self.blocks.release(req)
        self.pool.free(self.cache.reset())
        assert self.pool.num_free == NUM_PAGES and self.cache.num_pages == 0


TestCacheMachine = CacheMachine.TestCase
TestCacheMachine.settings = settings(max_examples=600, stateful_step_count=40, deadline=None)


def test_split_on_partial_match_and_lru_tail_eviction():
    pool, cache = tiny_pool(), RadixCache(PAGE)
    a = list(range(12))  # three pages
    cache.insert(a, pool.alloc(3))
    b = a[:4] + [99] * 8  # shares one page
    pages_b = pool.alloc(3)
    canonical, _ = cache.insert(b, pages_b)
    assert canonical[1:] == pages_b[1:] and canonical[0] != pages_b[0]
    pool.free(pages_b[:1])  # the duplicate first page
    # The root now has one child (the shared page) with two children.
    [shared] = cache.root.children.values()
    assert shared.key == a[:4] and len(shared.children) == 2
    cache.match_prefix(b)  # b is now more recently used than a
    freed = cache.evict(1)  # a single page from a's tail is enough
    assert len(freed) == 1
    events = cache.drain_events()
    assert [e.kind for e in events] == ["stored", "stored", "evicted"]
    assert events[-1].hashes == tuple(chain_hashes(a, PAGE)) and events[-1].start == 2  # a's third page
    assert cache.cached_len(a) == 8 and cache.cached_len(b) == 12


def test_locked_path_is_never_evicted():
    pool, cache = tiny_pool(), RadixCache(PAGE)
    _, node = cache.insert(list(range(8)), pool.alloc(2))
    cache.lock(node)
    assert cache.evict(10) == []
    cache.unlock(node)
    assert len(cache.evict(10)) == 2


def test_match_never_returns_the_whole_prompt_to_admit():
    """At least one token is left to compute: its logits produce the first output."""
    pool, cache = tiny_pool(), RadixCache(PAGE)
    blocks = BlockManager(pool, cache)
    tokens = list(range(8))
    cache.insert(tokens, pool.alloc(2))
    req = make_request(tokens)
    assert blocks.admit(req) == 4
    blocks.release(req)


def drain_into(mirror: GlobalPrefixTree, cache: RadixCache) -> list[CacheEvent]:
    events = cache.drain_events()
    mirror.apply_events(0, events)
    engine = {tuple(chain_hashes(leaf.path_tokens(), PAGE)) for leaf in cache.leaves}
    assert mirror.cached_sequences(0) == engine
    return events


def test_chunked_prefill_that_evicts_per_chunk_drains_as_one_store_and_one_eviction():
    pool, cache = tiny_pool(num_pages=8), RadixCache(PAGE)
    blocks, mirror = BlockManager(pool, cache), GlobalPrefixTree(1, page_size=PAGE)
    old = make_request(list(range(100, 125)), 0)  # six full pages, then cached
    blocks.admit(old)
    assert chunked_prefill(blocks, old, 2)
    blocks.release(old)
    drain_into(mirror, cache)
    new = make_request(list(range(200, 225)), 1)  # each chunk evicts a page of old's tail
    blocks.admit(new)
    assert chunked_prefill(blocks, new, 1)
    blocks.release(new)
    assert len(cache.events) == 11  # new's six pages stored one by one, old's five evicted
    events = drain_into(mirror, cache)
    assert [(e.kind, e.start) for e in events] == [("stored", 0), ("evicted", 1)]


def test_an_eviction_between_keeps_a_later_store_of_its_path_in_order():
    """The store of C continues the first store of A, but the eviction of A's tail came
    between and C's path runs through it: merging C into A's store would put C's pages in
    before the eviction that must not remove them."""
    pool, cache = tiny_pool(), RadixCache(PAGE)
    blocks, mirror = BlockManager(pool, cache), GlobalPrefixTree(1, page_size=PAGE)
    a = list(range(1, 9))
    for rid, tokens in enumerate([a, None, a + [0, 0, 0, 0], a + [0, 0, 0, 1]]):
        if tokens is None:
            cache.evict(1)  # A's second page
            continue
        req = make_request(tokens, rid)
        blocks.admit(req)
        assert chunked_prefill(blocks, req, 1)
        blocks.release(req)
    events = drain_into(mirror, cache)
    assert [e.kind for e in events] == ["stored", "evicted", "stored", "stored"]
