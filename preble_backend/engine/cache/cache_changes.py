"""The radix cache's changes, as it records them and as its readers get them: coalesced
into few events. A change names its path by chain hashes finalized from the sums its
nodes keep (one per page, ``TreeNode.sums``), so recording one hashes no token."""

from __future__ import annotations

from array import array
from dataclasses import dataclass
from typing import Literal

from preble_backend.common.cache_event import CacheEvent, Tier


@dataclass(frozen=True)
class Change:
    """A raw event: pages ``start`` onwards of the path whose page chain hashes are
    ``hashes`` stored in, or evicted from, ``tier``."""

    kind: Literal["stored", "evicted"]
    hashes: array
    start: int  # in pages
    tier: Tier = "device"


def coalesce(changes: list[Change]) -> list[CacheEvent]:
    """``changes`` as events, coalesced: a change that continues an earlier one down the
    same path in the same tier (chunked prefill stores a prompt chunk by chunk; eviction
    cuts a leaf's tail piece by piece) is merged into it, even when other changes came
    between, provided none of those is of the other kind in the same tier and touches the
    same pages (then the order matters and is kept; the host tier is mirrored apart, so
    its order relative to the others never does). A chunked prefill that evicts for each chunk is so
    reported as one store and one eviction, not one pair per chunk."""
    out: list[Change] = []
    for change in changes:
        for j in range(len(out) - 1, -1, -1):
            merged = _continued(out[j], change)
            if merged is not None:
                out[j] = merged
                break
            prior = out[j]
            if _ordered(prior, change) and _touches(prior, change.hashes):
                out.append(change)
                break
        else:
            out.append(change)
    return [CacheEvent(c.kind, tuple(c.hashes), c.start, c.tier) for c in out]


def _ordered(prior: Change, change: Change) -> bool:
    """Whether ``change`` must stay after ``prior`` where both touch the same pages: the
    other kind in the same tier, or a device change and a window change (a page's window
    is reported about while its device page is cached, so their order matters)."""
    if prior.tier == change.tier:
        return prior.kind != change.kind
    return {prior.tier, change.tier} == {"device", "window"}


def _touches(change: Change, path: array) -> bool:
    """Whether ``change``'s span holds a page of ``path`` (then a change on ``path`` cannot
    move past it). Both are paths from the root, so they share a page of the span exactly
    when they agree up to the end of its first page on both; the usual case differs at
    that page's hash and compares only it."""
    lo, hi = change.start, min(len(change.hashes), len(path))
    if lo >= hi:
        return False
    return change.hashes[lo] == path[lo] and change.hashes[:lo] == path[:lo]


def _continued(prior: Change, change: Change) -> Change | None:
    """``prior`` and ``change`` as one, if ``change`` continues it down its path."""
    if prior.kind != change.kind or prior.tier != change.tier:
        return None
    if prior.kind == "stored":  # the next pages of the same path
        if change.start == len(prior.hashes) and change.hashes[: change.start] == prior.hashes:
            return Change("stored", change.hashes, prior.start, prior.tier)
    elif len(change.hashes) == prior.start and prior.hashes[: prior.start] == change.hashes:
        return Change("evicted", prior.hashes, change.start, prior.tier)  # the pages above the cut
    return None
