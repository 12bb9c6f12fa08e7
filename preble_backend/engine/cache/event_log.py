"""The engine's cache events as a numbered log, so that every router that mirrors this
engine's cache sees every event, however else the engine is polled.

A reader names where it left off with a cursor, ``"<log id>/<sequence number>"``, and
gets the events after it and the cursor to send next time. The log keeps the last
``capacity`` events; a reader whose cursor it no longer reaches, or whose cursor belongs
to another log (the engine restarted, or the reader is new), gets a snapshot instead: the
whole cache as stored paths, to replace what it believed.
"""

from __future__ import annotations

import itertools
import uuid
from collections import deque
from collections.abc import Callable

from preble_backend.common.cache_event import CacheEvent, EventBatch


class EventLog:
    def __init__(self, capacity: int = 1 << 16) -> None:
        self.log_id = uuid.uuid4().hex[:16]
        self.capacity = capacity
        self._events: deque[CacheEvent] = deque()
        self._first = 0  # sequence number of _events[0]
        self._snapshot: EventBatch | None = None

    @property
    def next(self) -> int:
        return self._first + len(self._events)

    def append(self, events: list[CacheEvent]) -> None:
        self._events.extend(events)
        while len(self._events) > self.capacity:
            self._events.popleft()
            self._first += 1

    def read(self, cursor: str | None) -> EventBatch | None:
        """The events after ``cursor``, or None when the reader must take a snapshot."""
        log_id, _, seq = (cursor or "").partition("/")
        if log_id != self.log_id or not seq.isdigit() or not self._first <= int(seq) <= self.next:
            return None
        start = int(seq)
        events = list(itertools.islice(self._events, start - self._first, None))
        return EventBatch(self.log_id, start, self.next, events)

    def snapshot(self, cached_paths: Callable[[], list[CacheEvent]]) -> EventBatch:
        """A snapshot of the cache at the log's current position (``cached_paths`` lists
        it, with every event up to now in the log). The cache changes only through logged
        events, so readers that arrive before the next event share one snapshot: a burst
        of requests from a new router costs one walk of the cache, not one each."""
        if self._snapshot is None or self._snapshot.next != self.next:
            self._snapshot = EventBatch(self.log_id, self.next, self.next, cached_paths(), snapshot=True)
        return self._snapshot
