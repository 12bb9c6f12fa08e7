"""The radix cache and block manager keep their invariants under any sequence of
admissions, releases, matches and evictions (property-based), plus hand-made cases."""

from __future__ import annotations

from conftest import make_request, tiny_pool
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from preble_backend.block_hash import chain_hashes
from preble_backend.block_manager import BlockManager
from preble_backend.radix_cache import RadixCache
from preble_backend.request import Request
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

    @rule(tokens=token_lists)
    def admit_and_compute(self, tokens):
        req = make_request(tokens, self.next_id)
        self.next_id += 1
        cached = self.blocks.admit(req)
        assert cached % PAGE == 0 and cached < len(tokens)
        assert cached == len(req.page_table) * PAGE
        if not self.blocks.reserve(req, req.num_uncomputed):
            self.blocks.release(req)
            return
        for i in range(cached // PAGE, len(req.page_table)):  # "compute" the new pages
            self.content[req.page_table[i]] = tuple(tokens[i * PAGE : (i + 1) * PAGE])
        req.num_computed = req.num_tokens
        self.blocks.share_computed(req)
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
        assert self.cache.leaves == {n for n in nodes if not n.children}
        assert self.cache.num_pages == sum(len(n.pages) for n in nodes)
        assert self.cache.num_locked_pages == sum(len(n.pages) for n in nodes if n.lock_ref > 0)

    @invariant()
    def events_mirror_the_cache(self):
        self.mirror.apply_events(0, self.cache.drain_events())
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
        for req in self.held:
            self.blocks.release(req)
        self.pool.free(self.cache.reset())
        assert self.pool.num_free == NUM_PAGES and self.cache.num_pages == 0


TestCacheMachine = CacheMachine.TestCase
TestCacheMachine.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)


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
