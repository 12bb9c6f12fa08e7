"""A node of the radix cache (``radix_cache.py``): a run of whole pages of one path, in
the device pool or the host pool, with the host's copy of a device node's pages where the
host kept one since a load-back (``tier_moves.py``)."""

from __future__ import annotations

import itertools
from array import array
from dataclasses import dataclass, field

from preble_backend.common.block_hash import finalized

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
    # the hash sum at the end of each of its pages (``block_hash.page_sums``), made once at
    # insertion from its own tokens and its parent's last sum: the events that name its path
    # finalize them instead of hashing the path's tokens
    sums: array = field(default_factory=lambda: array("Q"))
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
            parts.append(node.sums)
            node = node.parent
        sums = array("Q")
        for part in reversed(parts):
            sums.extend(part)
        return finalized(sums)

    def has_device_child(self) -> bool:
        return any(not c.on_host for c in self.children.values())
