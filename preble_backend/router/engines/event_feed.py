"""The router's side of one engine's cache event log (``engine/cache/event_log.py``): the
cursor it sends with each request, and which events of a report it has not applied yet.

Reports arrive out of order (each request carries the cursor of the moment it was sent,
and requests finish in any order), so a report's events can overlap ones already
applied: only those past the cursor are new. A snapshot replaces what the router believed
about that engine's cache, unless it is older than what the router already has.
"""

from __future__ import annotations

from preble_backend.common.cache_event import CacheEvent, EventBatch


class EventFeed:
    def __init__(self) -> None:
        self.log_id: str | None = None
        self.next = 0

    @property
    def cursor(self) -> str:
        """What to send as ``events_since`` (empty: this router has no picture yet)."""
        return f"{self.log_id}/{self.next}" if self.log_id is not None else ""

    def take(self, batch: EventBatch) -> tuple[list[CacheEvent], bool]:
        """The events of ``batch`` to apply, and whether to forget the engine's cache first
        (a snapshot)."""
        if batch.snapshot:
            if batch.log_id == self.log_id and batch.next <= self.next:
                return [], False  # an older picture than the one applied
            self.log_id, self.next = batch.log_id, batch.next
            return batch.events, True
        if batch.log_id != self.log_id or batch.next <= self.next:
            return [], False  # from a log this router has resynced away from, or nothing new
        new = batch.events[max(0, self.next - batch.first) :]
        self.next = batch.next
        return new, False

    def reset(self) -> None:
        """The engine went away: the next report will be a snapshot."""
        self.log_id, self.next = None, 0
