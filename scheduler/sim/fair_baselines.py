"""The anchors' fairness rules as wait queues, for the simulator's comparison (issue 65).

Each keeps the paper's priority queue per tenant (``FairWaitQueue``) and changes only
which tenant admits next; each keeps its state where it runs, in one instance's wait
queue or, as the anchors keep theirs, in one router (``router_tier.py``):

- ``RoundRobinQueue``: llm-d's flow control in its fair mode: backlogged tenants take
  turns, one request each, whatever the request costs;
- ``DeficitQueue``: Dynamo's per-class deficit round-robin: each turn adds ``quantum``
  tokens (times the tenant's weight) to a tenant's deficit; it admits while the prompt's
  tokens fit its deficit, and a tenant that empties its queue loses what was left.
"""

from __future__ import annotations

from collections.abc import Iterator

from preble_backend.common.fair_share import TenantShares
from preble_backend.engine.scheduling.fair_queue import FairWaitQueue
from preble_backend.engine.scheduling.request import Request


class RoundRobinQueue(FairWaitQueue):
    orders_passes = False  # the anchors order admissions only: passes are the paper's

    def __init__(self, shares: TenantShares, num_groups: int = 10, quota_unit: int = 10) -> None:
        super().__init__(shares, num_groups, quota_unit)
        self.turns: list[str] = []  # tenants in the order they first arrived
        self.last: str | None = None  # the tenant that admitted last

    def push(self, request: Request, group: int, front: bool = False) -> None:
        if request.tenant not in self.turns:
            self.turns.append(request.tenant)
        super().push(request, group, front)

    def turn_order(self) -> list[str]:
        """Every tenant that ever queued, from the one after the last to admit (a tenant
        that first queues after that one's turn is after it too)."""
        n = len(self.turns)
        start = self.turns.index(self.last) + 1 if self.last in self.turns else 0
        return [self.turns[(start + i) % n] for i in range(n)]

    def take(self, request: Request) -> None:
        self.last = request.tenant
        super().take(request)


class DeficitQueue(RoundRobinQueue):
    def __init__(self, shares: TenantShares, num_groups: int = 10, quota_unit: int = 10,
                 quantum: int = 2048) -> None:  # fmt: skip
        super().__init__(shares, num_groups, quota_unit)
        self.quantum = quantum
        self.deficit: dict[str, float] = {}

    def candidates(self) -> Iterator[Request]:
        """In turn, each tenant whose next prompt fits its deficit; one whose does not gets
        a quantum more and waits for its next turn."""
        offered: set[int] = set()
        while True:
            pending = False
            for tenant in self.turn_order():
                nxt = self._next(tenant, offered)
                if nxt is None:
                    continue
                pending = True
                if self.deficit.get(tenant, 0.0) >= nxt.num_tokens:
                    offered.add(id(nxt))
                    yield nxt
                    break
                self.deficit[tenant] = self.deficit.get(tenant, 0.0) + self.quantum * self.shares.weight(
                    tenant
                )
            else:
                if not pending:
                    return

    def take(self, request: Request) -> None:
        self.deficit[request.tenant] = self.deficit.get(request.tenant, 0.0) - request.num_tokens
        super().take(request)
        if not len(self.queues[request.tenant]):
            self.deficit[request.tenant] = 0.0
