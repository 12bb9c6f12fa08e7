"""What the router believes of each engine's sliding-window layers: the window, and the
chain hashes of its cached pages whose sliding layers' KV is gone
(``preble_backend/engine/cache/sliding_windows.py``).

Such a page's full layers' KV is still cached, so the global tree keeps it; but a request
can start after a cached prefix only where the prefix's last window is held there
(``common/prefix.window_hit``), the same rule the engine's admission applies. Fed by the
engines' ``window`` cache events and their device evictions; E2 learns each window from
the engine's report.
"""

from __future__ import annotations

from collections.abc import Iterable

from preble_backend.common.cache_event import CacheEvent
from preble_backend.common.prefix import window_hit


class WindowMirror:
    def __init__(self, num_instances: int) -> None:
        self.windows = [0] * num_instances  # tokens; 0: no sliding layers
        self.gone: list[set[int]] = [set() for _ in range(num_instances)]

    def add_instance(self) -> None:
        self.windows.append(0)
        self.gone.append(set())

    def apply(self, instance: int, event: CacheEvent) -> None:
        """A ``window`` event: the span's sliding KV went (``evicted``) or came back."""
        span = event.hashes[event.start :]
        if event.kind == "evicted":
            self.gone[instance].update(span)
        else:
            self.gone[instance].difference_update(span)

    def evicted(self, instance: int, hashes: tuple[int, ...], start: int) -> None:
        """The device evicted the span: nothing of it is left to lack a window."""
        if self.gone[instance]:
            self.gone[instance].difference_update(hashes[start:])

    def forget(self, instance: int) -> None:
        self.gone[instance].clear()

    def lacks(self, instance: int) -> bool:
        """Whether hits on the instance can end short of what it caches."""
        return bool(self.windows[instance] and self.gone[instance])

    def hit(self, instance: int, path: Iterable[int], page_size: int) -> int:
        """Pages of a cached ``path`` (chain hashes) a request can start after there."""
        gone = self.gone[instance]
        return window_hit((h not in gone for h in path), self.windows[instance], page_size)
