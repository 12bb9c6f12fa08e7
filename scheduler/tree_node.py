"""The global prefix tree's nodes and what matching a prompt against them yields.

A node is a run of KV pages named by their chain hashes (``preble_backend/common/block_hash.py``).
Each chain hash names its whole prefix, so one comparison of a node's last hash tells
whether the whole node matches, and a partial match is a binary search (``common_prefix``).
"""

from __future__ import annotations

from array import array
from dataclasses import dataclass

from preble_backend.common.prefix import longest_match
from scheduler.window_mirror import WindowMirror

NO_REPLICAS: frozenset[int] = frozenset()  # shared: most nodes never get a replica


class GlobalNode:
    """A run of pages. Plain slots, not a dataclass: routing creates one or two per request
    and this is the cheapest way Python builds an object."""

    __slots__ = (
        "hashes", "parent", "children", "cached", "cached_kids",
        "pending", "hits", "replicas", "ttft", "merged",
    )  # fmt: skip

    def __init__(self, hashes: array, parent: GlobalNode | None = None) -> None:
        self.hashes = hashes  # chain hash of each page, root side first (uint64 array)
        self.parent = parent
        self.children: dict[int, GlobalNode] = {}  # by first chain hash
        self.cached: dict[int, int] = {}  # instance -> leading pages it caches (> 0)
        self.cached_kids: dict[int, int] = {}  # instance -> children it caches (> 0)
        self.pending: dict[int, int] = {}  # instance -> requests in flight (> 0)
        self.hits: dict[int, list[float]] = {}  # instance -> request times, oldest first
        self.replicas = NO_REPLICAS  # autoscaled copies (see e2.py); immutable, so splits share it
        self.ttft = None  # the key portion's time-to-first-token history (e2.py)
        self.merged: GlobalNode | None = None  # the node it was folded into (see live())

    def held_by(self, instance: int) -> bool:
        return instance in self.cached or instance in self.pending

    def held_pages(self, instance: int) -> int:
        """Pages the instance has: all of them for a request in flight, else those cached."""
        return len(self.hashes) if instance in self.pending else self.cached.get(instance, 0)

    def holders(self) -> set[int]:
        return self.cached.keys() | self.pending.keys()

    def path(self) -> list[GlobalNode]:
        nodes, node = [], self
        while node.parent is not None:
            nodes.append(node)
            node = node.parent
        return nodes[::-1]


@dataclass(slots=True)
class Match:
    """A prompt matched against the tree: the nodes it runs through and how many pages of
    each it matches (only the last may be partial). Counts are reported in tokens.
    ``key`` is the paper's key portion (§3): the deepest node on the path holding more
    tokens than all its predecessors together."""

    nodes: list[GlobalNode]
    lengths: list[int]
    page_size: int
    matched: int  # tokens: the pages of ``lengths`` together
    key: GlobalNode | None
    hosted: dict[int, int] | None = None  # instance -> pages its host tier adds (None: no tiers)
    windows: WindowMirror | None = None  # the tree's: whose sliding layers' KV of which pages is gone

    def hosted_on(self, instance: int) -> int:
        """Prompt tokens the instance's host tier holds right after what its device holds."""
        return self.hosted.get(instance, 0) * self.page_size if self.hosted else 0

    def pinned_on(self, instance: int) -> int:
        """Prompt tokens that requests in flight on the instance already hold: the matched
        path up to its first node without one (their marks run from the root)."""
        pages = 0
        for node, n in zip(self.nodes, self.lengths):
            if instance not in node.pending:
                break
            pages += n
        return pages * self.page_size

    def cached_on(self, instance: int) -> int:
        """Prompt tokens the instance holds: the matched path up to its first gap; with
        sliding-window layers, up to the last page its window is held before."""
        short = self.windows is not None and self.windows.lacks(instance)
        pages, path = 0, []
        for node, n in zip(self.nodes, self.lengths):
            held = min(node.held_pages(instance), n)
            pages += held
            if short:
                path.extend(node.hashes[:held])
            if held < n:
                break
        if short:
            pages = self.windows.hit(instance, path, self.page_size)
        return pages * self.page_size


def common_prefix(hashes: array, chain, pos: int) -> int:
    """How many of a node's pages ``chain[pos:]`` matches. A chain hash names its whole
    prefix, so the first ``n`` pages agree exactly when the ``n``-th hashes do."""
    limit = min(len(hashes), len(chain) - pos)
    return longest_match(limit, lambda n: n == 0 or chain[pos + n - 1] == hashes[n - 1])
