"""An engine's side of the fair shares (``common/fair_share.py``): the counter it adds to
as one source of the cluster's, what it reports to routers, and what it takes from them.

Each health probe from a router brings that router's copy of every tenant's service
(``shares``), merged here on the engine's thread; each answer carries this engine's copy,
the tenants waiting here and their weights. So every engine's wait queue orders tenants by
the service the whole cluster gave them, through whichever router: two routers carry the
counts between engines, and either one alone suffices. The tokens each router took for
capped tenants (``router/requests/token_budgets.py``) travel the same way: engines only
relay them, so every router's ``tokens_per_minute`` buckets see the others' spending.
"""

from __future__ import annotations

import uuid
from typing import TYPE_CHECKING

from preble_backend.common.fair_share import TenantShares

if TYPE_CHECKING:
    from preble_backend.engine.engine import Engine

SERVICE = "preble_tenant_service_tokens_total"  # declared with the engine's metrics (engine_model.py)
WAITING = "preble_engine_tenant_waiting_requests"


class TenantLedger:
    def __init__(self, engine: Engine, model_name: str) -> None:
        self.engine = engine
        scheduler = engine.scheduler
        self.shares = scheduler.shares  # None: fair_share is off
        if self.shares is not None:  # a restarted engine counts anew, beside what it counted before
            scheduler.source = f"{model_name}@{uuid.uuid4().hex[:8]}"
        self.source = scheduler.source
        self.spent = TenantShares()  # routers' tokens_per_minute counts (``token_budgets.py``)
        self._published: dict[str, float] = {}
        self._waiting: set[str] = set()

    def report(self) -> dict:
        """What a health answer carries: this engine's copy of the counts, its waiting, the
        weights; and the routers' counts of tokens taken for capped tenants, relayed."""
        spent = self.spent.snapshot()
        relayed = {"tokens_spent": spent} if spent else {}
        if self.shares is None:
            return relayed
        return {"tenants": {"service": self.shares.snapshot(), "waiting": self.waiting(),
                            "weights": dict(self.shares.weights)}, **relayed}  # fmt: skip

    def waiting(self) -> dict[str, int]:
        queues = getattr(self.engine.scheduler.waiting, "queues", {})
        return {tenant: len(queue) for tenant, queue in list(queues.items()) if len(queue)}

    def take(self, counts, spent=None) -> None:
        """A router's copy of the counts, merged on the engine's thread (its queue reads
        them); its copy of the tokens routers took, merged here (only relayed)."""
        if spent:
            self.spent.merge(spent)
        if self.shares is not None and counts:
            self.engine.run_in_loop(lambda: self.shares.merge(counts))

    def publish(self, metrics) -> None:
        if self.shares is None:
            return
        for tenant, served in self.shares.served_by(self.source).items():  # its own counts only
            if served != self._published.get(tenant, 0.0):
                metrics.count(SERVICE, served - self._published.get(tenant, 0.0), {"tenant": tenant})
                self._published[tenant] = served
        waiting = self.waiting()
        for tenant in self._waiting | set(waiting):
            metrics.gauge(WAITING, waiting.get(tenant, 0), {"tenant": tenant})
        self._waiting = set(waiting)
