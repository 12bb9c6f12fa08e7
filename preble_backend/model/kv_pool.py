"""The paged KV pool: preallocated K/V storage cut into fixed pages, and a free list.

Every page is owned by exactly one of: the free list, a running request's private tail, or
the radix cache. ``num_free`` plus what those two hold always equals ``num_pages``; tests
check that after every run.

A model with sliding-window layers keeps their KV in a second pool (``window``; vLLM's
hybrid KV cache manager calls it a KV cache group), so that the pages behind every
request's window can go back while the full-attention layers keep theirs. A page of this
pool names a span of tokens; ``window_of[page]`` is the window pool's page holding the
sliding layers' KV of the same span, or -1 where it is not held
(``engine/cache/sliding_windows.py`` decides which are).

Each page carries a generation stamp that ``free`` advances. A reader in another process
(``preble_backend/kv_transfer``) is offered pages with their stamps, reads the pages, then
reads the stamps again: a page freed (and so possibly reused) since the offer no longer
matches, and the read is discarded instead of decoded from. The stamps live in host memory
whatever the pool's device, so a remote agent can read them beside the pages.
"""

from __future__ import annotations

import numpy as np
import torch


class OutOfPages(Exception):
    """Raised when the pool cannot hand out the pages asked for (callers evict or preempt)."""


class KVPool:
    def __init__(
        self,
        num_pages: int,
        page_size: int,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
        pin_memory: bool = False,
    ) -> None:
        if page_size < 1 or page_size & (page_size - 1):
            raise ValueError(f"page_size must be a power of two >= 1, got {page_size}")
        if num_pages < 1:
            raise ValueError(f"the KV pool needs at least one page, got {num_pages}")
        self.num_pages = num_pages
        self.page_size = page_size
        shape = (num_layers, num_pages * page_size, num_kv_heads, head_dim)
        # pinned: a host tier's pool, which a GPU copies to and from without staging
        self.k_cache = torch.zeros(shape, dtype=dtype, device=device, pin_memory=pin_memory)
        self.v_cache = torch.zeros(shape, dtype=dtype, device=device, pin_memory=pin_memory)
        # Low page ids first: a LIFO stack keeps recently freed (cache-warm) pages in use.
        self._free: list[int] = list(range(num_pages - 1, -1, -1))
        self.stamps = np.zeros(num_pages, dtype=np.int64)  # generation per page
        self.window: KVPool | None = None  # the sliding layers' pool, where the model has them
        self.window_of: list[int] = []  # per page: its window pool page, -1 where none
        self.window_tokens = 0  # the sliding layers' widest window

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_pages - len(self._free)

    @property
    def capacity_tokens(self) -> int:
        return self.num_pages * self.page_size

    def alloc(self, n: int) -> list[int]:
        if n > len(self._free):
            raise OutOfPages(f"asked for {n} pages, {len(self._free)} free")
        if n == 0:
            return []
        pages = self._free[-n:]
        del self._free[-n:]
        return pages[::-1]

    def free(self, pages: list[int]) -> None:
        if pages:  # before any reuse can write into them
            self.stamps[pages] += 1
        self._free.extend(reversed(pages))

    def add_window(self, window: KVPool, tokens: int) -> None:
        """Keep the sliding layers' KV in ``window``, no page's held yet; ``tokens``: the
        widest of their windows."""
        self.window, self.window_of = window, [-1] * self.num_pages
        self.window_tokens = tokens

    def window_table(self, pages: list[int]) -> list[int]:
        """``pages`` as the window pool's pages; 0 where not held (never read: attention
        reads no page wholly before its window)."""
        of = self.window_of
        return [max(of[p], 0) for p in pages]

    def page_view(self, cache: torch.Tensor) -> torch.Tensor:
        """``cache`` indexed by page: (layers, pages, page_size, heads, head_dim)."""
        layers, _, heads, dim = cache.shape
        return cache.view(layers, self.num_pages, self.page_size, heads, dim)

    @staticmethod
    def pages_for(num_tokens: int, page_size: int) -> int:
        return -(-num_tokens // page_size)
