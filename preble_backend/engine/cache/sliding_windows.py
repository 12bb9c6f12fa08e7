"""Which pages keep their sliding layers' KV: the window pool's policy (``model/kv_pool.py``).

A query at position ``p`` of a sliding layer reads only the keys after ``p - window``, so a
running request needs the window pages of its last ``window - 1`` tokens and of the chunk
it computes, never those before. Each page's window page is in one of three states:

- *needed*: some running request's window covers it (``need`` counts them);
- *idle*: a radix-cache page no running request needs. It is kept, least recently needed
  first, so that a later request matching up to it still hits, and taken back when the
  window pool runs dry: a second LRU list beside the cache's own, as SGLang's SWA cache
  keeps one, but over pages, not tree nodes;
- *gone* (``window_of`` -1): the full layers' KV of the span may still be cached, but a
  request can start after it only where it recomputes the window. A request that does
  recomputes into pages of its own; when it hands them to the cache, their window pages
  pass to the cache's pages (``adopt``), so the cached prefix is whole again.

A prefix hit (``usable``) is therefore the longest cached prefix whose last window is held,
found right to left as vLLM's sliding-window manager finds it. The radix cache reports
windows that go and come back (``CacheEvent`` tier ``window``) so the global tree prices
the same hit.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable

from preble_backend.common.prefix import first_window_page, window_hit
from preble_backend.model.kv_pool import KVPool, OutOfPages


class SlidingWindows:
    def __init__(self, pool: KVPool, window: int) -> None:
        if pool.window is None:
            raise ValueError("the KV pool has no window pool")
        self.pool, self.store = pool, pool.window
        self.window, self.page_size = window, pool.page_size
        self.need = [0] * pool.num_pages  # per page: running requests whose window covers it
        self.idle: OrderedDict[int, None] = OrderedDict()  # cached pages holding one, needed by none
        self.on_drop: Callable[[list[int]], None] | None = None  # the cache reports what it lost

    @property
    def room(self) -> int:
        """Window pages a request could get: free ones and idle ones."""
        return self.store.num_free + len(self.idle)

    def first_needed(self, computed: int) -> int:
        """The first page whose window page a request with ``computed`` tokens computed
        still reads."""
        return first_window_page(computed, self.window, self.page_size)

    def usable(self, pages: list[int]) -> int:
        """How many leading ``pages`` (a cached prefix) a request can start after."""
        of = self.pool.window_of
        return window_hit((of[p] >= 0 for p in pages), self.window, self.page_size)

    def hold(self, pages: list[int]) -> None:
        """A request now reads these (held) pages' windows."""
        for page in pages:
            self.need[page] += 1
            self.idle.pop(page, None)

    def let_go(self, pages: list[int], cached: bool) -> None:
        """A request reads these pages' windows no more: a cached page's becomes idle, a
        private page's goes back to the window pool."""
        of, freed = self.pool.window_of, []
        for page in pages:
            self.need[page] -= 1
            if self.need[page]:
                continue
            if cached:
                self.idle[page] = None
            else:
                freed.append(of[page])
                of[page] = -1
        self.store.free(freed)

    def attach(self, pages: list[int]) -> None:
        """Window pages for new pages of a running request (which needs them): free ones
        first, then the least recently needed idle ones."""
        short = len(pages) - self.store.num_free
        if short > len(self.idle):
            raise OutOfPages(f"asked for {len(pages)} window pages, {self.room} to be had")
        if short > 0:
            self.evict(short)
        of = self.pool.window_of
        for page, slot in zip(pages, self.store.alloc(len(pages))):
            of[page] = slot
            self.need[page] = 1

    def evict(self, n: int) -> None:
        """Take back the ``n`` least recently needed idle window pages."""
        of, taken = self.pool.window_of, []
        for _ in range(n):
            page, _ = self.idle.popitem(last=False)
            self.store.free([of[page]])
            of[page] = -1
            taken.append(page)
        if self.on_drop is not None:
            self.on_drop(taken)

    def adopt(self, mine: int, theirs: int) -> bool:
        """A request's page ``mine`` duplicates the cache's ``theirs`` (and is about to be
        freed): its readers move over, and so does its window page where ``theirs`` has
        none. Whether ``theirs`` got one."""
        of, need = self.pool.window_of, self.need
        need[theirs] += need[mine]
        need[mine] = 0
        gained = of[theirs] < 0 <= of[mine]
        if gained:
            of[theirs], of[mine] = of[mine], -1
        if of[theirs] >= 0 and not need[theirs]:
            self.idle[theirs] = None
        else:
            self.idle.pop(theirs, None)
        return gained

    def drop(self, pages: list[int]) -> None:
        """Pages freed from the pool (no request reads them): their window pages too."""
        of, freed = self.pool.window_of, []
        for page in pages:
            if of[page] >= 0:
                freed.append(of[page])
                of[page] = -1
                self.idle.pop(page, None)
            self.need[page] = 0
        self.store.free(freed)


def window_report(pool: KVPool, windows: SlidingWindows | None) -> dict[str, int]:
    """The window pool's pages, and the window a router's hits must respect (the engine's
    stats; nothing without a window pool)."""
    window = pool.window
    if window is None or windows is None:
        return {}
    return {"sliding_window": pool.window_tokens, "kv_window_pages_total": window.num_pages,
            "kv_window_pages_used": window.num_used, "kv_window_pages_idle": len(windows.idle)}  # fmt: skip
