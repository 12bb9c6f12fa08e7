"""Fair shares between tenants: the service each received, counted as a virtual token
counter (VTC, "Fairness in Serving Large Language Models", OSDI '24), and kept so that
every router and engine that has seen the same reports holds the same numbers.

**Service is what a request cost**, not its token count: the prompt tokens an engine
actually computed weigh ``input_weight``, those its prefix cache served weigh
``cached_weight`` (0 by default: a tenant whose prompts hit the cache costs the cluster
little), and each output token ``output_weight`` (VTC's 1 and 2 by default).

**One counter for the cluster.** Each source (an engine, numbered by its restart epoch)
only ever adds to its own count of each tenant's service; a copy merges another by taking,
per (tenant, source), the larger count (a grow-only counter). So copies converge whatever
order reports arrive in, however often they repeat, and across a partition: each side
keeps counting its own sources, and the first report after it heals brings both to the
same totals. A router that restarts relearns the counts from the engines' next reports:
nobody's share goes back to zero.

**Scheduling by it** (``order``): the waiting tenant with the least service per unit of
weight goes first. A tenant that returns after idling would otherwise spend the credit it
banked while away, so it is lifted, as VTC lifts it, to the least normalized service of
the tenants already waiting (``lift``): fairness among the backlogged, not over all time.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Iterable
from dataclasses import dataclass, field

DEFAULT_TENANT = "default"


@dataclass
class ServiceWeights:
    input_weight: float = 1.0
    cached_weight: float = 0.0
    output_weight: float = 2.0

    def cost(self, computed: int, cached: int, output: int) -> float:
        return self.input_weight * computed + self.cached_weight * cached + self.output_weight * output


@dataclass
class TenantShares:
    """Tenants' weights, the service each received from each source, and the lifts."""

    weights: dict[str, float] = field(default_factory=dict)  # absent: weight 1
    service_weights: ServiceWeights = field(default_factory=ServiceWeights)
    counts: dict[str, dict[str, float]] = field(default_factory=dict)  # tenant -> source -> service
    floors: dict[str, float] = field(default_factory=dict)  # tenant -> normalized service lifted to
    # Counts change on one thread (an engine's loop, a router's monitor) and are copied out
    # on others: the changes and the copies hold this lock, reads on the changing thread need not.
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def weight(self, tenant: str) -> float:
        return self.weights.get(tenant, 1.0)

    def charge(self, tenant: str, source: str, computed: int = 0, cached: int = 0, output: int = 0) -> None:
        """``source`` served ``tenant`` this much more."""
        amount = self.service_weights.cost(computed, cached, output)
        if amount:
            with self._lock:
                by_source = self.counts.setdefault(tenant, {})
                by_source[source] = by_source.get(source, 0.0) + amount

    def service(self, tenant: str) -> float:
        return sum(self.counts.get(tenant, {}).values())

    def normalized(self, tenant: str) -> float:
        """Service per unit of weight, never below the tenant's lift."""
        return max(self.service(tenant) / self.weight(tenant), self.floors.get(tenant, 0.0))

    def lift(self, tenant: str, waiting: Iterable[str]) -> None:
        """``tenant`` becomes backlogged while ``waiting`` tenants already are: it starts
        no lower than the least of them (its own past service stands if higher)."""
        others = [self.normalized(t) for t in set(waiting) if t != tenant]
        if others:
            self.floors[tenant] = max(self.floors.get(tenant, 0.0), min(others))

    def order(self, tenants: Iterable[str]) -> list[str]:
        """``tenants`` least normalized service first; a tie (a lifted tenant meets the one
        it was lifted to) goes to the one served less in fact, then by name, so that every
        copy agrees."""
        return sorted(set(tenants), key=lambda t: (self.normalized(t), self.service(t) / self.weight(t), t))

    def snapshot(self) -> dict[str, dict[str, float]]:
        """What a source reports, or a copy sends another: JSON-safe."""
        with self._lock:
            return {tenant: dict(by_source) for tenant, by_source in self.counts.items()}

    def served_by(self, source: str) -> dict[str, float]:
        """What ``source`` alone served each tenant (an engine's own series)."""
        with self._lock:
            return {tenant: mine[source] for tenant, mine in self.counts.items() if source in mine}

    def merge(self, counts: dict[str, dict[str, float]]) -> None:
        """Take another copy's counts: per (tenant, source), the larger. What is not a
        count (a peer's report is input) is skipped, never merged."""
        if not isinstance(counts, dict):
            return
        with self._lock:
            for tenant, by_source in counts.items():
                if not isinstance(tenant, str) or not isinstance(by_source, dict):
                    continue
                mine = self.counts.setdefault(tenant, {})
                for source, value in by_source.items():
                    if isinstance(source, str) and _is_count(value) and value > mine.get(source, 0.0):
                        mine[source] = float(value)


def _is_count(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def jain_index(values: Iterable[float]) -> float:
    """Jain's fairness index: 1 when all are equal, 1/n when one has everything."""
    xs = [float(v) for v in values]
    if not xs or not any(xs):
        return 1.0
    return sum(xs) ** 2 / (len(xs) * sum(x * x for x in xs))
