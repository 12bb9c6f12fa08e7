"""Radix prefix cache over the paged KV pool (SGLang-style, page-granular).

Keys are token ids and matching compares them exactly, but storage is page-granular: every
node holds a whole number of full pages, and nodes split only at page boundaries. A
request's partially filled last page is therefore never shared: it stays private to the
request while it runs and goes back to the free list when it ends (its tokens are
recomputed by whoever needs them next). Full pages never change once written, so sharing
needs no copy-on-write.

Running requests hold a reference (``lock``) on the node that ends their cached prefix;
the reference protects the whole path to the root. Eviction takes unreferenced leaves in
least-recently-used order, and only the tail of a leaf when that is enough. Every page
added or removed is reported as a ``CacheEvent`` so a global scheduler can mirror the
cache exactly.
"""

from __future__ import annotations

import heapq
import itertools
from collections import deque
from dataclasses import dataclass, field
from typing import Literal

from preble_backend.common.cache_event import CacheEvent
from preble_backend.common.prefix import longest_match

_clock = itertools.count(1)


@dataclass(frozen=True)
class _Change:
    """A raw event, in tokens: ``tokens[start:]`` stored or evicted."""

    kind: Literal["stored", "evicted"]
    tokens: tuple[int, ...]
    start: int


@dataclass(eq=False)
class TreeNode:
    key: list[int] = field(default_factory=list)
    pages: list[int] = field(default_factory=list)
    parent: TreeNode | None = None
    children: dict[tuple[int, ...], TreeNode] = field(default_factory=dict)
    lock_ref: int = 0
    last_access: int = 0

    def path_tokens(self) -> list[int]:
        parts, node = [], self
        while node is not None:
            parts.append(node.key)
            node = node.parent
        return list(itertools.chain.from_iterable(reversed(parts)))


class RadixCache:
    def __init__(self, page_size: int) -> None:
        self.page_size = page_size
        self.root = TreeNode(lock_ref=1)  # the root is never evicted
        self.events: deque[_Change] = deque()  # appends and pops are thread-safe
        self.num_pages = 0  # pages held by the tree
        self.num_locked_pages = 0  # of those, pages on a path some request references
        self.leaves: set[TreeNode] = set()  # eviction candidates when unreferenced

    # ---- lookup ---------------------------------------------------------------------------

    def _first(self, tokens: list[int], pos: int) -> tuple[int, ...]:
        return tuple(tokens[pos : pos + self.page_size])

    def _common_pages(self, node: TreeNode, tokens: list[int], pos: int) -> int:
        """Whole pages of ``node`` that match ``tokens[pos:]`` (slice compares run in C)."""
        ps = self.page_size
        limit = min(len(node.pages), (len(tokens) - pos) // ps)
        return longest_match(limit, lambda n: node.key[: n * ps] == tokens[pos : pos + n * ps])

    def cached_len(self, tokens: list[int]) -> int:
        """How many leading tokens are cached (page-aligned), touching nothing."""
        node, pos = self.root, 0
        while (child := node.children.get(self._first(tokens, pos))) is not None:
            n = self._common_pages(child, tokens, pos)
            pos += n * self.page_size
            if n < len(child.pages):
                break
            node = child
        return pos

    def match_prefix(self, tokens: list[int]) -> tuple[list[int], TreeNode]:
        """Pages of the longest cached prefix and the node it ends at (split to fit)."""
        node, pos, pages = self.root, 0, []
        stamp = next(_clock)
        while (child := node.children.get(self._first(tokens, pos))) is not None:
            n = self._common_pages(child, tokens, pos)
            partial = n < len(child.pages)
            if partial:
                child = self._split(child, n)
            child.last_access = stamp
            pages.extend(child.pages)
            pos += n * self.page_size
            node = child
            if partial:
                break
        return pages, node

    def _split(self, node: TreeNode, n_pages: int) -> TreeNode:
        """Cut ``node`` after ``n_pages``; return the new upper half (same parent)."""
        cut = n_pages * self.page_size
        upper = TreeNode(
            key=node.key[:cut],
            pages=node.pages[:n_pages],
            parent=node.parent,
            lock_ref=node.lock_ref,
            last_access=node.last_access,
        )
        node.parent.children[self._first(upper.key, 0)] = upper
        node.key, node.pages, node.parent = node.key[cut:], node.pages[n_pages:], upper
        upper.children[self._first(node.key, 0)] = node
        return upper

    # ---- insertion ------------------------------------------------------------------------

    def insert(self, tokens: list[int], pages: list[int]) -> tuple[list[int], TreeNode]:
        """Cache ``tokens`` (whole pages only) stored in ``pages``.

        Returns the tree's pages for the sequence and its end node. Where the tree already
        held a prefix, its own pages win: the caller frees any of ``pages`` that differ.
        """
        ps = self.page_size
        usable = min(len(tokens) // ps, len(pages))
        tokens, pages = tokens[: usable * ps], pages[:usable]
        node, pos, canonical = self.root, 0, []
        stamp = next(_clock)
        while pos < len(tokens):
            child = node.children.get(self._first(tokens, pos))
            if child is None:
                leaf = TreeNode(key=tokens[pos:], pages=pages[pos // ps :], parent=node)
                leaf.last_access = stamp
                node.children[self._first(leaf.key, 0)] = leaf
                self.leaves.discard(node)
                self.leaves.add(leaf)
                self.num_pages += len(leaf.pages)
                canonical.extend(leaf.pages)
                self.events.append(_Change("stored", tuple(tokens), pos))
                return canonical, leaf
            n = self._common_pages(child, tokens, pos)
            if n < len(child.pages):
                child = self._split(child, n)
            child.last_access = stamp
            canonical.extend(child.pages)
            pos += n * ps
            node = child
        return canonical, node

    # ---- references -----------------------------------------------------------------------

    def lock(self, node: TreeNode) -> None:
        while node is not self.root:
            if node.lock_ref == 0:
                self.num_locked_pages += len(node.pages)
            node.lock_ref += 1
            node = node.parent

    def unlock(self, node: TreeNode) -> None:
        while node is not self.root:
            node.lock_ref -= 1
            if node.lock_ref == 0:
                self.num_locked_pages -= len(node.pages)
            node = node.parent

    @property
    def num_evictable_pages(self) -> int:
        return self.num_pages - self.num_locked_pages

    # ---- eviction -------------------------------------------------------------------------

    def evict(self, num_pages: int) -> list[int]:
        """Free at least ``num_pages`` pages (fewer if not enough are unreferenced), LRU first."""
        heap = [(n.last_access, id(n), n) for n in self.leaves if n.lock_ref == 0]
        heapq.heapify(heap)
        freed: list[int] = []
        while len(freed) < num_pages and heap:
            _, _, leaf = heapq.heappop(heap)
            keep = max(0, len(leaf.pages) - (num_pages - len(freed)))
            freed.extend(self._drop_tail(leaf, keep))
            parent = leaf.parent
            if keep == 0 and parent is not self.root and not parent.children and parent.lock_ref == 0:
                heapq.heappush(heap, (parent.last_access, id(parent), parent))
        return freed

    def _drop_tail(self, leaf: TreeNode, keep: int) -> list[int]:
        cut = keep * self.page_size
        path = leaf.path_tokens()
        start = len(path) - len(leaf.key) + cut
        self.events.append(_Change("evicted", tuple(path), start))
        dropped = leaf.pages[keep:]
        self.num_pages -= len(dropped)
        if keep == 0:
            del leaf.parent.children[self._first(leaf.key, 0)]
            self.leaves.discard(leaf)
            if leaf.parent is not self.root and not leaf.parent.children:
                self.leaves.add(leaf.parent)
        else:
            leaf.key, leaf.pages = leaf.key[:cut], leaf.pages[:keep]
        return dropped

    def reset(self) -> list[int]:
        """Drop every unreferenced page (used by tests and by ``flush_cache``)."""
        return self.evict(self.num_pages)

    def snapshot(self) -> list[CacheEvent]:
        """The whole cache as one stored event per maximal path (its leaves)."""
        return [CacheEvent.of("stored", leaf.path_tokens(), 0, self.page_size) for leaf in self.leaves]

    def drain_events(self) -> list[CacheEvent]:
        """Events since the last drain, safe to call from another thread, coalesced: an
        event that continues an earlier one down the same path (chunked prefill stores a
        prompt chunk by chunk; eviction cuts a leaf's tail piece by piece) is merged into
        it, even when events of the other kind came between, provided none of those touch
        the same pages (then the order matters and is kept). A chunked prefill that evicts
        for each chunk is so reported as one store and one eviction, not one pair per
        chunk. Paths are named by their chain hashes, computed here once per event."""
        out: list[_Change] = []
        for _ in range(len(self.events)):
            event = self.events.popleft()
            for j in range(len(out) - 1, -1, -1):
                merged = _continued(out[j], event)
                if merged is not None:
                    out[j] = merged
                    break
                if out[j].kind != event.kind and self._touches(out[j], event.tokens):
                    out.append(event)
                    break
            else:
                out.append(event)
        return [CacheEvent.of(c.kind, c.tokens, c.start, self.page_size) for c in out]

    def _touches(self, event: _Change, path: tuple[int, ...]) -> bool:
        """Whether ``event``'s span holds a page of ``path`` (then an event on ``path``
        cannot move past it). Both are paths from the root, so they share a page of the
        span exactly when they agree up to the end of its first page on both; the usual
        case differs inside that page and compares only it."""
        lo, hi = event.start, min(len(event.tokens), len(path))
        if lo >= hi:
            return False
        end = lo + self.page_size
        return event.tokens[lo:end] == path[lo:end] and event.tokens[:lo] == path[:lo]


def _continued(prior: _Change, event: _Change) -> _Change | None:
    """``prior`` and ``event`` as one event, if ``event`` continues it down its path."""
    if prior.kind != event.kind:
        return None
    if prior.kind == "stored":  # the next pages of the same path
        if event.start == len(prior.tokens) and event.tokens[: event.start] == prior.tokens:
            return _Change("stored", event.tokens, prior.start)
    elif len(event.tokens) == prior.start and prior.tokens[: prior.start] == event.tokens:
        return _Change("evicted", prior.tokens, event.start)  # the pages above the cut
    return None
