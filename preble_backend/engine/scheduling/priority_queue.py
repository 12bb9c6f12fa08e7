"""The paper's priority wait queue (§4.3): prefix sharing without starvation.

A waiting request joins priority group ``ceil(hit_ratio * P) - 1`` (0 when nothing is
cached), where ``hit_ratio`` is the fraction of its prompt already in the local cache.
Admission proceeds in rounds: in one round group ``g`` may admit up to ``(g + 1) * k``
requests, highest group first, FCFS inside a group. A round ends when every non-empty
group has spent its quota; then all quotas refill. So a group with more cached tokens
is served proportionally more often, and even group 0 is served every round.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterator

from preble_backend.engine.scheduling.request import Request


def priority_group(cached_tokens: int, prompt_tokens: int, num_groups: int) -> int:
    """``ceil(hit_ratio * P) - 1``, at least 0."""
    ratio = cached_tokens / prompt_tokens if prompt_tokens else 0.0
    return max(0, math.ceil(ratio * num_groups) - 1)


class PriorityWaitQueue:
    orders_passes = False  # no tenants: the running requests' chunks go oldest first

    def __init__(self, num_groups: int = 10, quota_unit: int = 10) -> None:
        if num_groups < 1 or quota_unit < 1:
            raise ValueError("priority_groups and the quota unit must be >= 1")
        self.num_groups = num_groups
        self.quota_unit = quota_unit
        self._groups: list[deque[Request]] = [deque() for _ in range(num_groups)]
        self._group_of: dict[int, int] = {}
        self._quota = [self._full_quota(g) for g in range(num_groups)]

    def _full_quota(self, group: int) -> int:
        return (group + 1) * self.quota_unit

    def group_for(self, cached_tokens: int, prompt_tokens: int) -> int:
        return priority_group(cached_tokens, prompt_tokens, self.num_groups)

    def push(self, request: Request, group: int, front: bool = False) -> None:
        """Queue a request; ``front`` puts a preempted request ahead of its group."""
        (self._groups[group].appendleft if front else self._groups[group].append)(request)
        self._group_of[id(request)] = group

    def candidates(self) -> Iterator[Request]:
        """Requests in the order this round admits them (each still needs ``take``)."""
        if not any(q and self._quota[g] > 0 for g, q in enumerate(self._groups)):
            self._quota = [self._full_quota(g) for g in range(self.num_groups)]
        for g in range(self.num_groups - 1, -1, -1):
            yield from list(self._groups[g])[: self._quota[g]]

    def take(self, request: Request) -> None:
        """Admit ``request``: leave the queue and spend one unit of its group's quota."""
        group = self._group_of.pop(id(request))
        self._groups[group].remove(request)
        self._quota[group] -= 1

    def remove(self, request: Request) -> bool:
        """Drop a waiting request (aborted); False if it was not waiting."""
        group = self._group_of.pop(id(request), None)
        if group is None:
            return False
        self._groups[group].remove(request)
        return True

    def __len__(self) -> int:
        return len(self._group_of)

    def __iter__(self) -> Iterator[Request]:
        for queue in self._groups:
            yield from queue
