"""The wait queue with fair shares between tenants (issue 65): the paper's priority wait
queue (§4.3) per tenant, the tenants taken by the service they received
(``common/fair_share.py``).

How the two combine: the tenant with the least service per unit of weight admits next,
and which of its requests it admits is the paper's order (its prefix-sharing groups and
their quotas). After each admission the tenants are ordered again, since the admitted
prompt's computed tokens were charged to its tenant at once; output tokens are charged as
they are computed. So within a tenant's share, prefix sharing still decides; between
tenants, the share does. With one tenant this is the paper's queue exactly.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator

from preble_backend.common.fair_share import TenantShares
from preble_backend.engine.scheduling.priority_queue import PriorityWaitQueue, priority_group
from preble_backend.engine.scheduling.request import Request


def fair_victim(shares: TenantShares, req: Request, running: list[Request], slots: int) -> Request | None:
    """With every one of the ``slots`` running slots taken, the request that gives ``req``
    its slot, or None. When all are taken, the slots are shared by weight among the tenants
    running and ``req``'s: ``req`` gets one while its tenant holds fewer than its share, from
    the tenant furthest over its own (its latest admitted request: the least progress lost).
    A tenant never displaces itself, and no one is displaced to put another over its share,
    so slots settle instead of changing hands back and forth. The request is preempted as
    memory pressure preempts: its computed pages stay in the cache, so it resumes with
    little to recompute."""
    held = Counter(r.tenant for r in running)
    weights = {t: shares.weight(t) for t in {*held, req.tenant}}
    total = sum(weights.values())
    if held[req.tenant] + 1 > slots * weights[req.tenant] / total:
        return None
    over = [t for t in held if t != req.tenant and held[t] > slots * weights[t] / total]
    if not over:
        return None
    most = max(over, key=lambda t: held[t] / weights[t])
    return next(r for r in reversed(running) if r.tenant == most)


class FairWaitQueue:
    orders_passes = True  # the prefill budget follows the shares too (LocalScheduler._prefill_order)

    def __init__(self, shares: TenantShares, num_groups: int = 10, quota_unit: int = 10) -> None:
        self.shares = shares
        self.num_groups, self.quota_unit = num_groups, quota_unit
        self.queues: dict[str, PriorityWaitQueue] = {}
        self._tenant_of: dict[int, str] = {}

    def group_for(self, cached_tokens: int, prompt_tokens: int) -> int:
        return priority_group(cached_tokens, prompt_tokens, self.num_groups)

    def _backlogged(self) -> list[str]:
        return [tenant for tenant, queue in self.queues.items() if len(queue)]

    def push(self, request: Request, group: int, front: bool = False) -> None:
        tenant = request.tenant
        if request.tenant_weight is not None:
            self.shares.weights[tenant] = request.tenant_weight
        queue = self.queues.get(tenant)
        if queue is None or not len(queue):  # it becomes backlogged: no banked credit
            self.shares.lift(tenant, self._backlogged())
            queue = self.queues.setdefault(tenant, PriorityWaitQueue(self.num_groups, self.quota_unit))
        queue.push(request, group, front)
        self._tenant_of[id(request)] = tenant

    def candidates(self) -> Iterator[Request]:
        """The next request of the least served tenant, again after every one taken."""
        offered: set[int] = set()
        while True:
            for tenant in self.turn_order():
                nxt = self._next(tenant, offered)
                if nxt is not None:
                    offered.add(id(nxt))
                    yield nxt
                    break
            else:
                return

    def turn_order(self) -> list[str]:
        """Which tenant admits next: the least served per unit of weight."""
        return self.shares.order(self._backlogged())

    def _next(self, tenant: str, offered: set[int]) -> Request | None:
        """``tenant``'s next request in the paper's order not offered yet."""
        queue = self.queues.get(tenant)
        return next((r for r in queue.candidates() if id(r) not in offered), None) if queue else None

    def take(self, request: Request) -> None:
        self.queues[self._tenant_of.pop(id(request))].take(request)

    def remove(self, request: Request) -> bool:
        tenant = self._tenant_of.pop(id(request), None)
        return tenant is not None and self.queues[tenant].remove(request)

    def __len__(self) -> int:
        return len(self._tenant_of)

    def __iter__(self) -> Iterator[Request]:
        for queue in self.queues.values():
            yield from queue
