"""A node of the radix cache (``radix_cache.py``): a run of whole pages of one path, in
the device pool or the host pool, with the host's copy of a device node's pages where the
host kept one since a load-back (``tier_moves.py``)."""

from __future__ import annotations

import itertools
from array import array
from dataclasses import dataclass, field

_created = itertools.count()


@dataclass(eq=False)
class TreeNode:
    key: list[int] = field(default_factory=list)
    pages: list[int] = field(default_factory=list)  # in the device pool, or the host pool
    parent: TreeNode | None = None
    children: dict[tuple[int, ...], TreeNode] = field(default_factory=dict)
    lock_ref: int = 0
    last_access: int = 0
    on_host: bool = False
    host_copy: list[int] = field(default_factory=list)  # a device node's pages, also on the host
    # the chain hash of each of its pages (``common/block_hash.py``), made once at insertion:
    # the events that name its path concatenate them instead of hashing the path's tokens
    hashes: array = field(default_factory=lambda: array("Q"))
    # breaks ties of last_access in the eviction heaps: by creation, not by memory address,
    # so that a run (the simulator's above all) repeats exactly
    order: int = field(default_factory=_created.__next__, repr=False)

    def path_tokens(self) -> list[int]:
        parts, node = [], self
        while node is not None:
            parts.append(node.key)
            node = node.parent
        return list(itertools.chain.from_iterable(reversed(parts)))

    def path_hashes(self) -> array:
        """The chain hashes of every page from the root to the end of this node."""
        parts, node = [], self
        while node is not None:
            parts.append(node.hashes)
            node = node.parent
        out = array("Q")
        for part in reversed(parts):
            out.extend(part)
        return out

    def has_device_child(self) -> bool:
        return any(not c.on_host for c in self.children.values())
