"""What the router believes each engine's host tier holds: the chain hashes of its host
pages (``preble_backend/engine/cache/host_tier.py``).

A chain hash names its page's whole prefix, so a set of them per engine is an exact
picture, and how far a prompt continues in an engine's host tier past what its device
holds is a run of set lookups. Along every engine path the device's pages come first, so
that run is all E2 needs (``Match.hosted``). Fed by the engines' host-tier cache events;
the device's events go to the global tree.
"""

from __future__ import annotations

from collections.abc import Sequence

from preble_backend.common.cache_event import CacheEvent


class HostTierMirror:
    def __init__(self, num_instances: int) -> None:
        self.pages: list[set[int]] = [set() for _ in range(num_instances)]
        self.total = 0  # pages over every instance: E2 looks no further while it is 0

    def add_instance(self) -> None:
        self.pages.append(set())

    def apply(self, instance: int, event: CacheEvent) -> None:
        pages, span = self.pages[instance], event.hashes[event.start :]
        before = len(pages)
        if event.kind == "stored":
            pages.update(span)
        else:
            pages.difference_update(span)
        self.total += len(pages) - before

    def forget(self, instance: int) -> None:
        self.total -= len(self.pages[instance])
        self.pages[instance].clear()

    def holders(self) -> list[int]:
        """The instances whose host tier holds anything (none, without tiers)."""
        return [i for i, pages in enumerate(self.pages) if pages]

    def run(self, instance: int, chain: Sequence[int], start: int) -> int:
        """Pages of ``chain`` from ``start`` on that the instance's host tier holds, in a row."""
        pages, end = self.pages[instance], start
        while end < len(chain) and chain[end] in pages:
            end += 1
        return end - start
