"""A key portion's times to first token within the window: autoscaling's "its queueing
doubled" sign (e2.py) compares the window's newer half with its older half."""

from __future__ import annotations

from collections import deque


class TTFTHistory:
    """A key portion's times to first token within the window, split at its midpoint into
    two FIFOs with running sums, so each completion costs O(1)."""

    def __init__(self) -> None:
        self.older: deque[tuple[float, float]] = deque()
        self.recent: deque[tuple[float, float]] = deque()
        self.older_sum = self.recent_sum = 0.0

    def add(self, now: float, ttft: float, window_s: float) -> None:
        self.recent.append((now, ttft))
        self.recent_sum += ttft
        half, horizon = now - window_s / 2, now - window_s
        while self.recent and self.recent[0][0] < half:
            sample = self.recent.popleft()
            self.recent_sum -= sample[1]
            self.older.append(sample)
            self.older_sum += sample[1]
        while self.older and self.older[0][0] < horizon:
            self.older_sum -= self.older.popleft()[1]

    def doubled(self, min_samples: int) -> bool:
        """Whether the recent half's mean is at least twice the older half's."""
        if len(self.older) < min_samples or len(self.recent) < min_samples:
            return False
        return self.recent_sum / len(self.recent) >= 2 * self.older_sum / len(self.older)
