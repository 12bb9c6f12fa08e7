"""The radix cache's moves between its tiers (``radix_cache.py`` holds the tree): a device
leaf evicted goes down to the host (copied, or by dropping its device pages when the host
kept a copy since a load-back), and a host continuation comes back up for a request that
matches it. Kept apart so that the tree's own file stays about the tree."""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Callable

from preble_backend.common.prefix import longest_match
from preble_backend.engine.cache.cache_changes import Change
from preble_backend.engine.cache.host_tier import HostTier
from preble_backend.engine.cache.radix_node import TreeNode
from preble_backend.model.kv_pool import KVPool


class TierMoves:
    """What ``RadixCache`` does across tiers; it supplies the tree, its counters and the
    tree operations used here (``_walk``, ``_split``, ``_cut``, ``lock``, ``evict``)."""

    host: HostTier | None
    root: TreeNode
    events: deque[Change]
    num_pages: int
    leaves: set[TreeNode]
    host_leaves: set[TreeNode]
    copies: set[TreeNode]
    _loading: set[TreeNode]

    def _evict_tail(self, leaf: TreeNode, keep: int, offload: bool) -> list[int]:
        """Free a device leaf's pages after the first ``keep``: they move down (with
        ``offload`` and a tier; with no copy when the host kept one) or are dropped, and
        with them the host nodes below the leaf."""
        if leaf.host_copy and offload:
            return self._move_down(leaf, keep, None)
        if leaf.host_copy:
            self._drop_copy(leaf, keep)
        if self.host is not None and offload:
            n = len(leaf.pages) - keep
            if self.host.pool.num_free < n:
                self.evict_host(n - self.host.pool.num_free)
            host_pages = self.host.offload(leaf.pages[keep:])
            if host_pages is not None:
                return self._move_down(leaf, keep, host_pages)
        if self.host is not None:
            self._drop_below(leaf)  # they hang below the tail that goes
        return self._cut(leaf, keep)

    def load_back(
        self,
        tokens: list[int],
        node: TreeNode,
        pos: int,
        pool: KVPool,
        keep: Callable[[int], int] = lambda loaded: 0,
        wait: bool = False,
        beside: bool = False,
    ) -> tuple[list[int], TreeNode] | None:
        """Bring the host tier's continuation of a device prefix (ending at ``node``, token
        ``pos``) back into ``pool``, as much of it as the pool can make room for while
        ``keep(n)`` pages stay free when ``n`` come back (the request's first chunk, which
        begins where the load-back ends); its device pages and new end node. The request
        computes what stays behind, and all of it when the copy fails. With ``wait``, a
        continuation that cannot come back whole is not touched (None): the request waits
        for room rather than recompute what the host holds, and nothing is evicted or
        copied for a request that is not admitted."""
        chain = self._walk(tokens, on_host=True, node=node, pos=pos) if self.host else []
        if not chain:
            return [], node
        self.host.settle()
        need = sum(len(c.pages) for c in chain)
        self.lock(node)  # neither the device path nor the pages coming up may go to make room
        self._loading.update(chain)
        try:
            room = _most(need, keep, pool.num_free + self.num_evictable_pages)
            if wait and room < need:
                return None
            want = room + keep(room)
            if room > 0 and pool.num_free < want:
                pool.free(self.evict(want - pool.num_free))
        finally:
            self._loading.difference_update(chain)
            self.unlock(node)
        chain = self._fit(chain, _most(room, keep, pool.num_free))
        fitted = sum(len(c.pages) for c in chain)
        self.host.stats.pages_short += need - fitted
        pages = pool.alloc(fitted)
        if not chain or not self.host.load([p for c in chain for p in c.pages], pages, beside):
            pool.free(pages)
            return [], node
        at = 0
        for c in chain:
            self._promote(c, pages[at : at + len(c.pages)])
            at += len(c.pages)
        return pages, chain[-1]

    def _fit(self, chain: list[TreeNode], room: int) -> list[TreeNode]:
        """The leading nodes of ``chain`` that ``room`` pages hold, the last split to fit."""
        fitted = []
        for c in chain:
            if room <= 0:
                break
            if len(c.pages) > room:
                c = self._split(c, room)
            fitted.append(c)
            room -= len(c.pages)
        return fitted

    def _promote(self, node: TreeNode, pages: list[int]) -> None:
        """A host node's pages are on the device now (``pages``); its host pages stay, as
        the node's copy, until the host needs their room."""
        path = node.path_hashes()
        self.num_pages += len(pages)
        node.on_host, node.host_copy, node.pages = False, node.pages, list(pages)
        self.copies.add(node)
        self.host_leaves.discard(node)
        self.leaves.discard(node.parent)
        self.leaves.add(node)
        self.events.append(Change("stored", path, len(path) - len(node.pages)))

    def _move_down(self, leaf: TreeNode, keep: int, host_pages: list[int] | None) -> list[int]:
        """``leaf``'s pages after the first ``keep`` now live in ``host_pages`` (None: in the
        host copy it kept); the device pages they leave."""
        path = leaf.path_hashes()
        start = len(path) - len(leaf.pages) + keep
        if keep:
            self.leaves.add(self._split(leaf, keep))  # its only child goes down
        dropped = leaf.pages
        self.leaves.discard(leaf)
        if host_pages is None:
            host_pages, leaf.host_copy = leaf.host_copy, []
            self.copies.discard(leaf)
            self.host.stats.pages_reused += len(dropped)
        else:
            self.events.append(Change("stored", path, start, "host"))
        leaf.on_host, leaf.pages = True, host_pages
        if not leaf.children:
            self.host_leaves.add(leaf)
        self.num_pages -= len(dropped)
        parent = leaf.parent
        if parent is not self.root and not parent.has_device_child():
            self.leaves.add(parent)
        self.events.append(Change("evicted", path, start))
        return dropped

    def _drop_copy(self, node: TreeNode, keep: int = 0) -> int:
        """Free the host copy of a device node's pages after the first ``keep``; how many."""
        self.host.finish_loads()  # a load beside the pass may still read them
        dropped, node.host_copy = node.host_copy[keep:], node.host_copy[:keep]
        if not node.host_copy:
            self.copies.discard(node)
        path = node.path_hashes()
        start = len(path) - len(node.pages) + keep
        self.events.append(Change("evicted", path, start, "host"))
        self.host.pool.free(dropped)
        return len(dropped)

    def evict_host(self, num_pages: int, copies: bool = True) -> int:
        """Drop at least ``num_pages`` host pages (fewer if the tier holds fewer). With
        ``copies`` (room for an offload, or a reset) the copies of device nodes go first,
        the most recently used node's first: it is evicted last, so its copy is the least
        likely to spare a copy, and copies ahead remake one before its eviction comes; then
        the host's own leaves, least recently used first, the only KV of their prefixes.
        Without (room for copies ahead, which must not trade one copy for another), the
        host's own leaves only. Measured against dropping the host's own leaves first:
        docs/benchmarks/host-tier.md, "Host order with copies ahead"."""
        self.host.settle()
        self.host.finish_loads()
        freed = 0
        if copies:
            heap = [(-n.last_access, n.order, n) for n in self.copies]
            heapq.heapify(heap)
            while freed < num_pages and heap:
                freed += self._drop_copy(heapq.heappop(heap)[2])
        heap = [(n.last_access, n.order, n) for n in self.host_leaves if n not in self._loading]
        heapq.heapify(heap)
        while freed < num_pages and heap:
            _, _, leaf = heapq.heappop(heap)
            keep = max(0, len(leaf.pages) - (num_pages - freed))
            dropped = self._cut(leaf, keep)
            self.host.pool.free(dropped)
            freed += len(dropped)
            parent = leaf.parent
            if keep == 0 and parent.on_host and not parent.children and parent not in self._loading:
                heapq.heappush(heap, (parent.last_access, parent.order, parent))
        return freed

    def copy_ahead(self, window: int) -> int:
        """Copy down the pages that the next evictions take, before they take them: of the
        ``window`` least recently used unreferenced device pages (leaf by leaf, the last
        split to fit), those without a host copy. They stay on the device as copies, so
        evicting them later copies nothing; the host makes their room from its own leaves
        only, never from other copies, once for all of them (one pass over its leaves, not
        one per leaf). The pages copied."""
        if self.host is None or window <= 0:
            return 0
        chosen = [leaf for leaf in self._next_evicted(window) if not leaf.host_copy]
        need = sum(len(leaf.pages) for leaf in chosen)
        if self.host.pool.num_free < need:
            self.evict_host(need - self.host.pool.num_free, copies=False)
        copied = 0
        for leaf in chosen:
            host_pages = self.host.offload(leaf.pages, ahead=True)
            if host_pages is None:
                break
            leaf.host_copy = host_pages
            self.copies.add(leaf)
            path = leaf.path_hashes()
            self.events.append(Change("stored", path, len(path) - len(leaf.pages), "host"))
            copied += len(host_pages)
        return copied

    def _next_evicted(self, window: int) -> list[TreeNode]:
        """The device nodes that the next evictions of ``window`` pages take, in their order
        (as ``evict`` goes: leaves least recently used first, a parent once its device
        children are taken), the last split so that it ends the window."""
        heap = [(n.last_access, n.order, n) for n in self.leaves if n.lock_ref == 0]
        heapq.heapify(heap)
        taken: dict[TreeNode, None] = {}  # ordered, and a set for the parents' test
        while window > 0 and heap:
            _, _, leaf = heapq.heappop(heap)
            if len(leaf.pages) > window:
                self._split(leaf, len(leaf.pages) - window)  # ``leaf`` keeps the tail, evicted first
            window -= len(leaf.pages)
            taken[leaf] = None
            parent = leaf.parent
            if (
                parent is not self.root
                and parent.lock_ref == 0
                and all(c.on_host or c in taken for c in parent.children.values())
            ):
                heapq.heappush(heap, (parent.last_access, parent.order, parent))
        return list(taken)

    def _drop_below(self, node: TreeNode) -> None:
        """Drop the host nodes under ``node`` (deepest first), before ``node`` itself goes."""
        for child in list(node.children.values()):
            if child.on_host:
                self._drop_below(child)
                self.host.pool.free(self._cut(child, 0))


def _most(limit: int, keep: Callable[[int], int], free: int) -> int:
    """The most pages, up to ``limit``, that can come back while ``keep`` of them stay
    free (a page more coming back never leaves less to keep free in all)."""
    return longest_match(limit, lambda n: n + keep(n) <= free)
