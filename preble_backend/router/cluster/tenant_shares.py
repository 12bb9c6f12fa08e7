"""A router's copy of the tenants' service (``common/fair_share.py``), and what it says of them.

The counts live in the engines, which charge them; a router holds a merged copy it learns
from every health probe's answer and hands back with the next probe, so counts one
engine charged reach the others through any router (``engine_server/tenant_ledger.py``).
A router that restarts starts from nothing and has every count back after one probe of
each engine: nobody's share goes to zero.

The fairness index is Jain's over the service each backlogged tenant (one with requests
waiting in some engine) received per unit of weight over the last ``window_s``: 1 when
the backlogged share as their weights say, 1/n when one takes everything.
"""

from __future__ import annotations

import time
from collections import deque

from preble_backend.common.fair_share import TenantShares, jain_index
from preble_backend.router.requests.token_budgets import TokenBudgets

IN_FLIGHT = "preble_router_tenant_in_flight"
FAIRNESS = "preble_tenant_fairness_index"


class ClusterShares:
    def __init__(self, window_s: float = 60.0, metrics=None, budgets: TokenBudgets | None = None) -> None:
        self.metrics = metrics  # the in-flight gauges move as requests come and go
        self.budgets = budgets  # the tokens_per_minute buckets: their counts travel beside the service
        self.shares = TenantShares()
        self.window_s = window_s
        self.waiting: dict[int, dict[str, int]] = {}  # engine -> tenant -> requests waiting there
        self.in_flight: dict[str, int] = {}  # tenant -> this router's requests forwarded or queued
        self._history: deque[tuple[float, dict[str, float]]] = deque()  # (when, tenant -> service)

    def learn(self, instance: int, load: dict, now: float | None = None) -> None:
        """A health answer's ``tenants``: the engine's copy of the counts, its waiting, the weights."""
        if self.budgets is not None and "tokens_spent" in load:
            self.budgets.learn(load["tokens_spent"])
        report = load.get("tenants")
        if not isinstance(report, dict):
            return
        self.shares.merge(report.get("service", {}))
        weights = report.get("weights", {})
        if isinstance(weights, dict):
            self.shares.weights.update({t: float(w) for t, w in weights.items()
                                        if isinstance(w, int | float) and w > 0})  # fmt: skip
        waiting = report.get("waiting")
        waiting = waiting if isinstance(waiting, dict) else {}
        self.waiting[instance] = {t: n for t, n in waiting.items() if isinstance(n, int)}
        now = time.monotonic() if now is None else now
        if not self._history or now - self._history[-1][0] >= 1.0:
            self._history.append((now, {t: self.shares.service(t) for t in self.shares.counts}))
        while len(self._history) > 2 and now - self._history[1][0] >= self.window_s:
            self._history.popleft()

    def forget(self, instance: int) -> None:
        """An engine that went down or left: what waited there waits no more."""
        self.waiting.pop(instance, None)

    def probe_fields(self) -> dict:
        """What the next health probe carries: this router's copy of the counts (and of the
        tokens each router took for capped tenants)."""
        return {"shares": self.shares.snapshot(), **(self.budgets.probe_fields() if self.budgets else {})}

    def backlogged(self) -> set[str]:
        return {t for waiting in self.waiting.values() for t, n in waiting.items() if n > 0}

    def fairness_index(self) -> float:
        """Jain's index over the backlogged tenants' service per unit of weight in the window."""
        if len(self._history) < 2:
            return 1.0
        (_, then), (_, now) = self._history[0], self._history[-1]
        served = {t: now.get(t, 0.0) - then.get(t, 0.0) for t in self.backlogged()}
        return jain_index(amount / self.shares.weight(t) for t, amount in served.items())

    def opened(self, tenant: str, weight: float | None = None) -> None:
        """A request of ``tenant`` admitted (of that weight, as the front named it)."""
        self.in_flight[tenant] = self.in_flight.get(tenant, 0) + 1
        if weight is not None:
            self.shares.weights[tenant] = weight
        if self.metrics is not None:
            self.metrics.gauge(IN_FLIGHT, self.in_flight[tenant], {"tenant": tenant})

    def closed(self, tenant: str) -> None:
        self.in_flight[tenant] -= 1
        if self.metrics is not None:
            self.metrics.gauge(IN_FLIGHT, self.in_flight[tenant], {"tenant": tenant})

    def publish(self, metrics) -> None:
        metrics.gauge(FAIRNESS, self.fairness_index())
