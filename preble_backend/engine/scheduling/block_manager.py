"""Gives requests their KV pages: cached prefix from the radix cache, the rest from the pool.

The three moments of a request's memory life:
- ``admit``: look up the longest cached prefix (loading back what the host tier holds of
  it), reference it, start computing after it;
- ``reserve``: before each iteration, pages for the tokens it will compute (evicting
  unreferenced cache when the pool runs dry);
- ``release``: on finish, abort or preemption, hand its full computed pages to the cache
  (so a recompute or a later turn hits them) and free the rest.

With sliding-window layers (``cache/sliding_windows.py``) each moment also minds the
window pool: a hit is the longest match whose last window is held; a reservation gives
each new page a window page and first lets go of those behind the request's window.
"""

from __future__ import annotations

from collections.abc import Callable

from preble_backend.engine.cache.radix_cache import RadixCache
from preble_backend.engine.cache.sliding_windows import SlidingWindows
from preble_backend.engine.scheduling.request import Request
from preble_backend.model.kv_pool import KVPool


class BlockManager:
    def __init__(self, pool: KVPool, cache: RadixCache | None, windows: SlidingWindows | None = None) -> None:
        self.pool = pool
        self.cache = cache  # None: prefix caching off
        self.windows = windows  # None: no sliding layers
        self.page_size = pool.page_size
        self.before_evict: Callable[[], None] | None = None  # the local scheduler's (it knows who waits)

    def tier_traffic(self) -> tuple[int, int]:
        """Tokens brought back from the host tier and copied down to it, in all (pages moved
        down with no copy, because the host kept theirs, are not copied): the host tier's
        own counts."""
        host = self.cache.host if self.cache is not None else None
        if host is None:
            return 0, 0
        return host.stats.pages_loaded * self.page_size, host.stats.pages_offloaded * self.page_size

    def join_loads(self, reqs: list[Request] | None = None) -> None:
        """The passes from here on read what loads beside earlier passes wrote: all of it
        (``reqs`` None), or what ``reqs`` read of pages still coming up."""
        if self.cache is not None and self.cache.host is not None:
            pages = None if reqs is None else [p for r in reqs for p in r.page_table]
            self.cache.host.join(pages)

    def copy_ahead(self, window: int) -> int:
        """When the next iteration may evict (fewer than ``window`` pages free), copy the
        ``window`` pages it would take first down to the host tier now, so that its
        eviction waits for no copy; the tokens copied."""
        if self.cache is None or self.cache.host is None or self.pool.num_free >= window:
            return 0
        return self.cache.copy_ahead(window) * self.page_size

    def admit(
        self, req: Request, first_chunk: int = 0, wait: bool = False, beside: bool = False, owed: int = 0
    ) -> int | None:
        """Attach the cached prefix; return how many tokens it saves. At least one token is
        always left to compute, since sampling needs its logits. What the host tier holds
        of it comes back leaving room for the pages of its ``first_chunk`` tokens after it;
        with ``wait`` (others running), room for the rest of its prompt and the ``owed``
        pages the running requests still need (the local scheduler admits only then), and
        all of it or (None: not admitted, nothing touched) none; with ``beside``, copied
        beside the next forward pass (the request joins the one after)."""
        if self.cache is None:
            return 0
        tokens = req.tokens(0, req.num_tokens - 1)
        pages, node = self.cache.match_prefix(tokens)
        pos = len(pages) * self.page_size
        ps = self.page_size

        def keep(loaded: int) -> int:  # the first chunk starts where the load-back ends
            rest = req.num_tokens - pos - loaded * ps
            if wait:
                return KVPool.pages_for(rest, ps) + owed
            return KVPool.pages_for(min(first_chunk, rest), ps)

        back = self.cache.load_back(tokens, node, pos, self.pool, keep, wait, beside)
        if back is None:
            return None
        loaded, node = back
        pages += loaded
        if self.windows is not None:  # past the last held window, recomputed
            pages = pages[: self.windows.usable(pages)]
            req.window_from = self.windows.first_needed(len(pages) * ps)
            self.windows.hold(pages[req.window_from :])
        self.cache.lock(node)
        req.cache_node = node
        req.page_table = list(pages)
        req.num_tree_pages = len(pages)
        req.num_computed = len(pages) * self.page_size
        return req.num_computed

    def room(self) -> int:
        """The pages a reservation could have now: free ones and the evictable cache."""
        return self.pool.num_free + (self.cache.num_evictable_pages if self.cache is not None else 0)

    def pages_needed(self, req: Request, num_new_tokens: int) -> int:
        total = KVPool.pages_for(req.num_computed + num_new_tokens, self.page_size)
        return max(0, total - len(req.page_table))

    def reserve(self, req: Request, num_new_tokens: int) -> bool:
        self._slide(req)
        need = self.pages_needed(req, num_new_tokens)
        short = need - self.pool.num_free
        if self.windows is not None and need > self.windows.room:
            return False
        if short > 0:
            if self.cache is None or short > self.cache.num_evictable_pages:
                return False  # no eviction could make the room: the cache stays whole
            if self.before_evict is not None:
                self.before_evict()
            self.free(self.cache.evict(short))
            if need > self.pool.num_free:
                return False
        pages = self.pool.alloc(need)
        if self.windows is not None:
            self.windows.attach(pages)
        req.page_table.extend(pages)
        return True

    def _slide(self, req: Request) -> None:
        """Let go of the window pages behind the request's window."""
        if self.windows is None:
            return
        start, end = req.window_from, self.windows.first_needed(req.num_computed)
        if end > start:
            self._let_go(req, start, end)
            req.window_from = end

    def _let_go(self, req: Request, start: int, end: int) -> None:
        cached = min(max(req.num_tree_pages, start), end)
        self.windows.let_go(req.page_table[start:cached], cached=True)
        self.windows.let_go(req.page_table[cached:end], cached=False)

    def free(self, pages: list[int]) -> None:
        """Pages back to the pool, with their window pages."""
        if self.windows is not None:
            self.windows.drop(pages)
        self.pool.free(pages)

    def share_computed(self, req: Request) -> None:
        """Put the request's full computed pages into the cache while it still runs, so
        requests arriving behind it hit them; its reference moves to the new end node."""
        if self.cache is None:
            return
        full = req.num_computed // self.page_size
        if full <= req.num_tree_pages:
            return
        tokens = req.tokens(0, full * self.page_size)
        canonical, node = self.cache.insert(tokens, req.page_table[:full])
        pairs = zip(req.page_table[req.num_tree_pages : full], canonical[req.num_tree_pages :])
        duplicates = [(mine, theirs) for mine, theirs in pairs if mine != theirs]
        if self.windows is not None:  # the cache's pages take over what the request computed
            gained = [theirs for mine, theirs in duplicates if self.windows.adopt(mine, theirs)]
            self.cache.report_windows("stored", gained)
        req.page_table[:full] = canonical
        self.cache.lock(node)
        self.cache.unlock(req.cache_node)
        self.free([mine for mine, _ in duplicates])
        req.cache_node = node
        req.num_tree_pages = full

    def release(self, req: Request) -> None:
        self.share_computed(req)
        if self.windows is not None:
            self._let_go(req, req.window_from, len(req.page_table))
            req.window_from = 0
        if req.cache_node is not None:
            self.cache.unlock(req.cache_node)
        self.free(req.page_table[req.num_tree_pages :])
        req.page_table = []
        req.num_tree_pages = 0
        req.cache_node = None
        req.num_computed = 0
