"""Radix prefix cache over the paged KV pool (SGLang-style, page-granular), with an
optional host tier below it.

Keys are token ids and matching compares them exactly, but storage is page-granular: every
node holds a whole number of full pages, and nodes split only at page boundaries. A
request's partially filled last page is therefore never shared: it stays private to the
request while it runs and goes back to the free list when it ends (its tokens are
recomputed by whoever needs them next). Full pages never change once written, so sharing
needs no copy-on-write.

Running requests hold a reference (``lock``) on the node that ends their cached prefix;
the reference protects the whole path to the root. Eviction takes unreferenced device
leaves in least-recently-used order, and only the tail of a leaf when that is enough.

With a host tier (``host_tier.py``) an evicted node is copied down instead of dropped: it
stays in the tree, its pages now host pages (``on_host``), and a request that matches it
loads it back (``load_back``). A node loaded back keeps its host pages as a copy
(``host_copy``, as HiCache keeps a loaded-back node's host value), so evicting it again
copies nothing; when the host needs room it drops its own leaves by its own LRU, and
those copies only then. Along every path the device's nodes come first, so device
eviction takes nodes with no device child. Every page added, moved
or removed is reported as a ``CacheEvent`` naming its tier, so a global scheduler can
mirror both tiers exactly (a copy is a host store over the device node's span).

With sliding-window layers (``windows``, ``sliding_windows.py``) a device page may have
lost its sliding layers' KV while the full layers' stays cached: the cache knows each
page's node (``node_of``) to report such pages (tier ``window``), and a hit is the longest
match whose last window is held.
"""

from __future__ import annotations

import heapq
import itertools
from collections import deque
from typing import Literal

from preble_backend.common.block_hash import page_sums
from preble_backend.common.cache_event import CacheEvent
from preble_backend.common.prefix import longest_match
from preble_backend.engine.cache.cache_changes import Change, coalesce
from preble_backend.engine.cache.host_tier import HostTier
from preble_backend.engine.cache.radix_node import TreeNode
from preble_backend.engine.cache.sliding_windows import SlidingWindows
from preble_backend.engine.cache.tier_moves import TierMoves

_clock = itertools.count(1)


class RadixCache(TierMoves):
    def __init__(
        self, page_size: int, host: HostTier | None = None, windows: SlidingWindows | None = None
    ) -> None:
        self.page_size = page_size
        self.host = host  # None: evicted pages are dropped
        self.windows = windows  # None: no sliding layers
        self.node_of: dict[int, TreeNode] = {}  # device page -> its node, kept only with windows
        if windows is not None:
            if host is not None:
                raise ValueError("host_kv_tokens / host_kv_ratio is invalid for a model with sliding-window "
                                 "layers: the host tier does not hold their KV yet")  # fmt: skip
            windows.on_drop = lambda pages: self.report_windows("evicted", pages)
        self.root = TreeNode(lock_ref=1)  # the root is never evicted
        self.events: deque[Change] = deque()  # appends and pops are thread-safe
        self.num_pages = 0  # device pages held by the tree
        self.num_locked_pages = 0  # of those, pages on a path some request references
        self.leaves: set[TreeNode] = set()  # device nodes without a device child: eviction candidates
        self.host_leaves: set[TreeNode] = set()  # host nodes without children
        self.copies: set[TreeNode] = set()  # device nodes whose pages the host also holds
        self._loading: set[TreeNode] = set()  # host nodes a load-back is bringing up

    # ---- lookup ---------------------------------------------------------------------------

    def _first(self, tokens: list[int], pos: int) -> tuple[int, ...]:
        return tuple(tokens[pos : pos + self.page_size])

    def _common_pages(self, node: TreeNode, tokens: list[int], pos: int) -> int:
        """Whole pages of ``node`` that match ``tokens[pos:]`` (slice compares run in C)."""
        ps = self.page_size
        limit = min(len(node.pages), (len(tokens) - pos) // ps)
        return longest_match(limit, lambda n: node.key[: n * ps] == tokens[pos : pos + n * ps])

    def cached_len(self, tokens: list[int]) -> int:
        """How many leading tokens are cached in either tier (page-aligned), touching
        nothing; with sliding layers, how many a request could start after."""
        node, pos, pages = self.root, 0, []
        while (child := node.children.get(self._first(tokens, pos))) is not None:
            n = self._common_pages(child, tokens, pos)
            pos += n * self.page_size
            if self.windows is not None:
                pages += child.pages[:n]
            if n < len(child.pages):
                break
            node = child
        return pos if self.windows is None else self.windows.usable(pages) * self.page_size

    def match_prefix(self, tokens: list[int]) -> tuple[list[int], TreeNode]:
        """Pages of the longest prefix cached on the device and the node it ends at (split
        to fit)."""
        nodes = self._walk(tokens, on_host=False, node=self.root, pos=0)
        return [p for n in nodes for p in n.pages], nodes[-1] if nodes else self.root

    def touch(self, tokens: list[int]) -> None:
        """Mark the device prefix of ``tokens`` just used, so LRU eviction takes it last."""
        self._walk(tokens, on_host=False, node=self.root, pos=0)

    def _walk(self, tokens: list[int], on_host: bool, node: TreeNode, pos: int) -> list[TreeNode]:
        """The nodes of one tier that match ``tokens`` from ``node`` at token ``pos`` on,
        the last split to fit; each touched for the LRU."""
        nodes, stamp = [], next(_clock)
        while (child := node.children.get(self._first(tokens, pos))) is not None and child.on_host == on_host:
            n = self._common_pages(child, tokens, pos)
            partial = n < len(child.pages)
            if partial:
                child = self._split(child, n)
            child.last_access = stamp
            nodes.append(child)
            pos += n * self.page_size
            node = child
            if partial:
                break
        return nodes

    def _split(self, node: TreeNode, n_pages: int) -> TreeNode:
        """Cut ``node`` after ``n_pages``; return the new upper half (same parent, tier)."""
        cut = n_pages * self.page_size
        upper = TreeNode(
            key=node.key[:cut],
            pages=node.pages[:n_pages],
            parent=node.parent,
            lock_ref=node.lock_ref,
            last_access=node.last_access,
            on_host=node.on_host,
            host_copy=node.host_copy[:n_pages],
            sums=node.sums[:n_pages],
        )
        node.parent.children[self._first(upper.key, 0)] = upper
        if self.windows is not None and not node.on_host:
            self.node_of.update(dict.fromkeys(upper.pages, upper))
        node.key, node.pages, node.parent = node.key[cut:], node.pages[n_pages:], upper
        node.sums = node.sums[n_pages:]
        if upper.host_copy:
            node.host_copy = node.host_copy[n_pages:]
            self.copies.add(upper)
        upper.children[self._first(node.key, 0)] = node
        return upper

    # ---- insertion ------------------------------------------------------------------------

    def insert(self, tokens: list[int], pages: list[int]) -> tuple[list[int], TreeNode]:
        """Cache ``tokens`` (whole pages only) stored in ``pages``.

        Returns the tree's pages for the sequence and its end node. Where the tree already
        held a prefix on the device, its own pages win: the caller frees any of ``pages``
        that differ. A prefix the host tier holds takes ``pages`` as its device copy.
        """
        ps = self.page_size
        usable = min(len(tokens) // ps, len(pages))
        tokens, pages = tokens[: usable * ps], pages[:usable]
        node, pos, canonical = self.root, 0, []
        stamp = next(_clock)
        while pos < len(tokens):
            child = node.children.get(self._first(tokens, pos))
            if child is None:
                key = tokens[pos:]  # hashed on from where the parent's sums end
                sums = page_sums(key, ps, pos, node.sums[-1] if node.sums else 0)
                leaf = TreeNode(key=key, pages=pages[pos // ps :], parent=node, sums=sums)
                leaf.last_access = stamp
                node.children[self._first(leaf.key, 0)] = leaf
                self.leaves.discard(node)
                self.leaves.add(leaf)
                self.num_pages += len(leaf.pages)
                canonical.extend(leaf.pages)
                self.events.append(Change("stored", leaf.path_hashes(), pos // ps))
                if self.windows is not None:
                    self.node_of.update(dict.fromkeys(leaf.pages, leaf))
                    of = self.windows.pool.window_of
                    self.report_windows("evicted", [p for p in leaf.pages if of[p] < 0])
                return canonical, leaf
            n = self._common_pages(child, tokens, pos)
            if n < len(child.pages):
                child = self._split(child, n)
            if child.on_host:
                self._promote(child, pages[pos // ps : pos // ps + n])
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

    @property
    def num_host_pages(self) -> int:
        """Host pages the tree holds: every page of the host pool in use is a tree's."""
        return self.host.pool.num_used if self.host is not None else 0

    # ---- eviction -------------------------------------------------------------------------

    def evict(self, num_pages: int, offload: bool = True) -> list[int]:
        """Free at least ``num_pages`` device pages (fewer if not enough are unreferenced),
        LRU first; with a host tier (and ``offload``) their contents move down."""
        if self.host is not None:
            self.host.settle()  # copies ahead read the device pages this frees
        heap = [(n.last_access, n.order, n) for n in self.leaves if n.lock_ref == 0]
        heapq.heapify(heap)
        freed: list[int] = []
        while len(freed) < num_pages and heap:
            _, _, leaf = heapq.heappop(heap)
            keep = max(0, len(leaf.pages) - (num_pages - len(freed)))
            freed.extend(self._evict_tail(leaf, keep, offload))
            parent = leaf.parent
            if (
                keep == 0
                and parent is not self.root
                and not parent.has_device_child()
                and parent.lock_ref == 0
            ):
                heapq.heappush(heap, (parent.last_access, parent.order, parent))
        if self.host is not None:
            self.host.join(freed)  # whatever reuses them runs after the loads still writing them
        return freed

    def _cut(self, leaf: TreeNode, keep: int) -> list[int]:
        """Drop ``leaf``'s pages after the first ``keep`` (all: the node goes) from its tier."""
        cut = keep * self.page_size
        path = leaf.path_hashes()
        start = len(path) - len(leaf.pages) + keep
        self.events.append(Change("evicted", path, start, "host" if leaf.on_host else "device"))
        dropped = leaf.pages[keep:]
        if not leaf.on_host:
            self.num_pages -= len(dropped)
            for page in dropped if self.windows is not None else ():
                del self.node_of[page]
        if keep:
            leaf.key, leaf.pages, leaf.sums = leaf.key[:cut], leaf.pages[:keep], leaf.sums[:keep]
            return dropped
        parent = leaf.parent
        del parent.children[self._first(leaf.key, 0)]
        if leaf.on_host:
            self.host_leaves.discard(leaf)
            if parent.on_host and not parent.children:
                self.host_leaves.add(parent)
        else:
            self.leaves.discard(leaf)
            if parent is not self.root and not parent.has_device_child():
                self.leaves.add(parent)
        return dropped

    def reset(self) -> list[int]:
        """Drop every unreferenced page of both tiers (used by tests and by ``flush_cache``);
        the device pages freed."""
        freed = self.evict(self.num_pages, offload=False)
        if self.host is not None:
            self.evict_host(self.num_host_pages)
        return freed

    def snapshot(self) -> list[CacheEvent]:
        """The whole cache as stored events: one per maximal device path, one per host
        leaf from where its path enters the host tier, and one per host copy."""
        events = [CacheEvent("stored", tuple(leaf.path_hashes()), 0) for leaf in self.leaves]
        for leaf in self.host_leaves:
            top, below = leaf, len(leaf.pages)
            while top.parent.on_host:
                top = top.parent
                below += len(top.pages)
            path = leaf.path_hashes()
            events.append(CacheEvent("stored", tuple(path), len(path) - below, "host"))
        for node in self.copies:
            path = node.path_hashes()
            events.append(CacheEvent("stored", tuple(path), len(path) - len(node.pages), "host"))
        if self.windows is not None:
            of = self.windows.pool.window_of
            gone = self._window_changes("evicted", [p for p in self.node_of if of[p] < 0])
            events += [CacheEvent(c.kind, tuple(c.hashes), c.start, c.tier) for c in gone]
        return events

    def report_windows(self, kind: Literal["stored", "evicted"], pages: list[int]) -> None:
        """Report that these device pages gained or lost their sliding layers' KV."""
        self.events.extend(self._window_changes(kind, pages))

    def _window_changes(self, kind: Literal["stored", "evicted"], pages: list[int]) -> list[Change]:
        """One change per run of consecutive pages of one node among ``pages``."""
        by_node: dict[TreeNode, set[int]] = {}
        for page in pages:
            by_node.setdefault(self.node_of[page], set()).add(page)
        changes = []
        for node, mine in by_node.items():
            path = node.path_hashes()
            offset = len(path) - len(node.pages)
            indices = [i for i, page in enumerate(node.pages) if page in mine]
            first = indices[0]
            for prev, i in zip(indices, indices[1:] + [-1]):
                if i != prev + 1:  # a run ends at prev
                    changes.append(Change(kind, path[: offset + prev + 1], offset + first, "window"))
                    first = i
        return changes

    def drain_events(self) -> list[CacheEvent]:
        """Events since the last drain, safe to call from another thread, coalesced
        (``cache_changes.coalesce``); paths are named by chain hashes once per event."""
        return coalesce([self.events.popleft() for _ in range(len(self.events))])
