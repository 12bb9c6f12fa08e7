"""The host tier: KV pages the device pool evicted, kept in host memory so that a request
whose prefix is there loads it back instead of recomputing it (SGLang's HiCache, vLLM's
offloading connector and LMCache, Dynamo's KVBM keep evicted prefixes one tier down the
same way).

The radix cache decides what moves (``radix_cache.py``, ``tier_moves.py``); this module
owns the host pool and the copies. Copies write back: a page is copied down when the
device evicts it, and a page loaded back keeps its host copy until an offload needs its
room (copies go first, the newest first), so evicting it again copies nothing. Why, by
measurement: docs/ENGINE.md, "The host tier".

A copy is a gather and a scatter per cache. On a GPU the host pool is pinned and pages
cross through pinned memory as one DMA per cache; a load-back is queued on the compute
stream (its pages are written before the forward that reads them), while an offload at
eviction waits for its gather to reach host memory before the device pages are freed:
one synchronisation per eviction. Copies ahead of eviction (``host_copy_ahead``,
``TierMoves.copy_ahead``) take that wait off the loop: on a GPU they run on a side
stream beside the forward pass and land in the host pool at the next tier operation
(``settle``); on a CPU they are done in place. A load-back for a request that joins the
next batch runs on the same side stream beside the pass (``join`` orders the passes
that read its pages after it). A copy that raises moves nothing: the caller recomputes
or drops instead, and no page changes.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import TypeVar

import torch

from preble_backend.model.kv_pool import KVPool

log = logging.getLogger("preble.engine")
T = TypeVar("T")


@dataclass
class HostTierStats:
    pages_offloaded: int = 0  # device -> host, at eviction
    pages_copied_ahead: int = 0  # device -> host beside a forward pass, before their eviction
    pages_reused: int = 0  # evicted with no copy: the host had kept theirs since a load-back
    pages_loaded: int = 0  # host -> device
    pages_loaded_beside: int = 0  # of those, beside a forward pass that did not read them
    loadbacks: int = 0  # requests whose prefix came back from the host
    pages_short: int = 0  # left on the host (and recomputed) for want of device room
    bytes_moved: int = 0
    load_s: float = 0.0  # host time spent issuing and (on CPU) doing load-backs
    copy_failures: int = 0


class HostTier:
    def __init__(self, device: KVPool, host: KVPool) -> None:
        if host.page_size != device.page_size or host.k_cache.shape[2:] != device.k_cache.shape[2:]:
            raise ValueError("the host pool must have the device pool's page size and KV shape")
        self.device = device
        self.pool = host
        self.stats = HostTierStats()
        per_token = device.k_cache[:, :1].numel() * device.k_cache.element_size() * 2
        self.bytes_per_page = per_token * device.page_size
        on_gpu = device.k_cache.device.type == "cuda"
        self.stream = torch.cuda.Stream(device.k_cache.device) if on_gpu else None  # copies beside
        self._behind: deque[tuple[torch.cuda.Event, list[torch.Tensor], list[int]]] = deque()
        self._loads: list[tuple[torch.cuda.Event, set[int]]] = []  # loads beside: device pages written

    def report(self) -> dict[str, float]:
        """The engine's load report and metrics: the tier's size, use and traffic."""
        s = self.stats
        return {"kv_host_pages_total": self.pool.num_pages, "kv_host_pages_used": self.pool.num_used,
                "host_pages_offloaded": s.pages_offloaded, "host_pages_loaded": s.pages_loaded,
                "host_loadbacks": s.loadbacks, "host_bytes_moved": s.bytes_moved,
                "host_load_s": round(s.load_s, 6), "host_copy_failures": s.copy_failures,
                "host_pages_short": s.pages_short, "host_pages_reused": s.pages_reused,
                "host_pages_copied_ahead": s.pages_copied_ahead,
                "host_pages_loaded_beside": s.pages_loaded_beside}  # fmt: skip

    def offload(self, device_pages: list[int], ahead: bool = False) -> list[int] | None:
        """Copy device pages down (``ahead``: pages still cached on the device, copied before
        their eviction); their host pages, or None when the host pool lacks the room (the
        caller makes it first) or the copy failed."""
        if len(device_pages) > self.pool.num_free:
            return None
        host_pages = self.pool.alloc(len(device_pages))
        if ahead and self.stream is not None:
            copied = self._copy_beside(device_pages, host_pages)
        else:
            copied = self._copy(self.device, device_pages, self.pool, host_pages)
        if not copied:
            self.pool.free(host_pages)
            return None
        if ahead:
            self.stats.pages_copied_ahead += len(device_pages)
        else:
            self.stats.pages_offloaded += len(device_pages)
        return host_pages

    def load(self, host_pages: list[int], device_pages: list[int], beside: bool = False) -> bool:
        """Copy host pages into (already allocated) device pages; False if it failed.
        ``beside``: on a GPU, on the side stream beside the next forward pass, whose
        requests do not read these pages (``join`` orders the passes that do)."""
        started = time.perf_counter()
        if beside and self.stream is not None:
            ok = self._load_beside(host_pages, device_pages)
        else:
            ok = self._copy(self.pool, host_pages, self.device, device_pages)
        if ok:
            self.stats.pages_loaded += len(host_pages)
            self.stats.pages_loaded_beside += len(host_pages) if beside else 0
            self.stats.loadbacks += 1
            self.stats.load_s += time.perf_counter() - started
        return ok

    def _copy_beside(self, device_pages: list[int], host_pages: list[int]) -> bool:
        """Gather the pages into pinned host memory beside the forward pass; ``settle``
        lands them in the host pool."""
        gather = partial(gather_pages, self.device, device_pages, torch.device("cpu"), non_blocking=True)
        ran = self._beside(gather, len(device_pages), "copy ahead")
        if ran is not None:
            self._behind.append((*ran, host_pages))
        return ran is not None

    def _load_beside(self, host_pages: list[int], device_pages: list[int]) -> bool:
        load = partial(copy_pages, self.pool, host_pages, self.device, device_pages)
        ran = self._beside(load, len(host_pages), "load")
        if ran is not None:
            self._loads.append((ran[0], set(device_pages)))
        return ran is not None

    def _beside(self, work: Callable[[], T], num_pages: int, what: str) -> tuple[torch.cuda.Event, T] | None:
        """Run ``work`` on the side stream, after the compute stream's work so far (the
        passes that wrote or freed its pages): the event that marks it done and its
        result, or None if it raised (nothing moved)."""
        try:
            self.stream.wait_stream(torch.cuda.current_stream(self.stream.device))
            with torch.cuda.stream(self.stream):
                out = work()
                done = torch.cuda.Event()
                done.record(self.stream)
        except Exception:
            log.exception("KV %s of %d pages beside the pass failed", what, num_pages)
            self.stats.copy_failures += 1
            return None
        self.stats.bytes_moved += num_pages * self.bytes_per_page
        return done, out

    def join(self, pages: list[int] | None = None) -> None:
        """Order the compute stream after the loads made beside earlier passes: all of them
        (an iteration's start), or those writing any of ``pages`` (pages a batch reads, or
        pages an eviction frees for reuse)."""
        if not self._loads:
            return
        wanted = None if pages is None else set(pages)
        stream = torch.cuda.current_stream(self.stream.device)
        for done, written in self._loads:
            if wanted is None or not written.isdisjoint(wanted):
                stream.wait_event(done)
        self._loads = [(done, written) for done, written in self._loads if not done.query()]

    def finish_loads(self) -> None:
        """Wait for every load made beside a pass: before host pages it reads are freed."""
        for done, _ in self._loads:
            done.synchronize()
        self._loads = []

    def settle(self) -> None:
        """Land the copies made beside earlier forward passes (each waits for its transfer,
        done by now unless the pass was shorter): before the radix cache frees or reuses
        their device pages, or reads or frees their host pages."""
        while self._behind:
            done, gathered, host_pages = self._behind.popleft()
            done.synchronize()
            scatter_pages(gathered, self.pool, host_pages)

    def _copy(self, src: KVPool, src_pages: list[int], dst: KVPool, dst_pages: list[int]) -> bool:
        try:
            copy_pages(src, src_pages, dst, dst_pages)
        except Exception:  # nothing moved: the destination pages are the caller's to return
            log.exception("KV copy of %d pages between tiers failed", len(src_pages))
            self.stats.copy_failures += 1
            return False
        self.stats.bytes_moved += len(src_pages) * self.bytes_per_page
        return True


def copy_pages(src: KVPool, src_pages: list[int], dst: KVPool, dst_pages: list[int]) -> None:
    """``dst``'s pages ``dst_pages`` take the contents of ``src``'s ``src_pages`` (both
    caches, every layer): one gather and one scatter per cache. Nothing is written until
    the gathered pages exist, so a failure leaves ``dst`` as it was. Between a GPU and the
    host, the pages cross as one DMA per cache through pinned memory: a copy up is queued
    on the compute stream, a copy down waits for its transfer before the host scatter."""
    if not src_pages:
        return
    gathered = gather_pages(src, src_pages, dst.k_cache.device, non_blocking=True)
    if src.k_cache.device.type == "cuda" and dst.k_cache.device.type == "cpu":
        torch.cuda.current_stream(src.k_cache.device).synchronize()
    scatter_pages(gathered, dst, dst_pages)


def gather_pages(
    src: KVPool, pages: list[int], device: torch.device, non_blocking: bool
) -> list[torch.Tensor]:
    """``src``'s ``pages`` of its K and V caches, every layer, moved to ``device``. From a
    pinned host pool to a GPU the pages are gathered into pinned memory first: a gather
    from the pool lands in pageable memory, whose copy up is staged and synchronous (that
    path loaded a 4k-token prefix of the 8B-shaped model back on an H200 at about 1.1
    GB/s, 3× its recompute). A GPU's pages copied down with ``non_blocking`` land in
    pinned memory."""
    to_gpu = src.k_cache.device.type == "cpu" and torch.device(device).type == "cuda"
    gathered = []
    for cache in (src.k_cache, src.v_cache):
        index = page_index(pages, cache.device)
        view = src.page_view(cache)
        if to_gpu:
            shape = (view.shape[0], len(pages), *view.shape[2:])
            staged = torch.empty(shape, dtype=view.dtype, pin_memory=True)
            torch.index_select(view, 1, index, out=staged)
            gathered.append(staged.to(device, non_blocking=non_blocking))
        else:
            gathered.append(view.index_select(1, index).to(device, non_blocking=non_blocking))
    return gathered


def scatter_pages(gathered: list[torch.Tensor], dst: KVPool, pages: list[int]) -> None:
    """Write ``gather_pages``' K and V into ``dst``'s ``pages``."""
    index = page_index(pages, dst.k_cache.device)
    for cache, values in zip((dst.k_cache, dst.v_cache), gathered):
        dst.page_view(cache).index_copy_(1, index, values)


def page_index(pages: list[int], device: torch.device) -> torch.Tensor:
    """``pages`` as an index on ``device``: to a GPU through pinned memory, queued on the
    current stream (``torch.tensor(..., device=...)`` would wait for every copy queued
    there before it, the load beside the pass included)."""
    index = torch.tensor(pages)
    return index.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else index
