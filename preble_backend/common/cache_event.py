"""What an engine's prefix cache reports so a global scheduler can mirror it exactly: cache
events, and the batches of them an engine's event log hands each reader.

Each event names a tier. Along any path the device's pages come first and the host
tier's follow (a page is on the host only once the device evicted it), so a page moving
down is ``evicted`` from the device and ``stored`` on the host, and a load-back the
reverse."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from preble_backend.common.block_hash import chain_hashes

# device memory, or the host-memory tier below it; or "window": the sliding layers' KV of
# device pages whose full layers' KV stays cached (engine/cache/sliding_windows.py), which a
# request can start after only where the last window before it is held
Tier = Literal["device", "host", "window"]


@dataclass(frozen=True)
class CacheEvent:
    """Pages ``start`` onwards of a path from the root were stored in, or evicted from, the
    cache; the pages before ``start`` stay cached above them. The path is named by its page
    chain hashes (``block_hash``), the currency the global scheduler matches prompts in."""

    kind: Literal["stored", "evicted"]
    hashes: tuple[int, ...]  # chain hash of every page of the path, root first
    start: int  # first page of the span
    tier: Tier = "device"  # where the span's pages are, or were (engine/cache/host_tier.py)

    @classmethod
    def of(cls, kind: Literal["stored", "evicted"], tokens, start: int, page_size: int,
           tier: Tier = "device") -> CacheEvent:  # fmt: skip
        """The event for ``tokens[start:]`` (``start`` in tokens, page-aligned)."""
        return cls(kind, tuple(chain_hashes(tokens, page_size)), start // page_size, tier)


@dataclass(frozen=True)
class EventBatch:
    log_id: str
    first: int  # sequence number of events[0]; for a snapshot, the log's position it shows
    next: int  # where the reader continues: its next cursor is f"{log_id}/{next}"
    events: list[CacheEvent]
    snapshot: bool = False  # events are the whole cache: forget the rest

    @property
    def cursor(self) -> str:
        return f"{self.log_id}/{self.next}"
