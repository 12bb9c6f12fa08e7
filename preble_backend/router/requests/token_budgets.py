"""Each tenant's ``tokens_per_minute`` (the keys file's option), for the whole cluster: a
token bucket per tenant that holds a minute's tokens and refills continuously. A request is
refused while its tenant's bucket is empty; its prompt tokens are taken when it is
tokenized and its output tokens when it ends, so a request is never cut off for a cap
it passed at admission (a bucket may go below zero, and the tenant then waits longer).

**Several routers, one cap.** Each router counts the tokens it took for each capped tenant
as its own source of a grow-only counter (``TenantShares``, as the tenants' service is
counted); the counts travel through the engines with the health probes and their
answers, and each router takes from its buckets what the others spent since it last
heard. So a tenant has its tokens per minute through all routers together, give or take
what was spent in the last probe interval (``health_interval_s``) and not heard of yet.
A partition lets each side spend a minute's worth until it heals; then the other side's
spending is taken, and the tenant waits it out. A router that restarts starts with full
buckets and a new source: what the others spend counts from its first answer on.
"""

from __future__ import annotations

import math
import threading
import time
import uuid
from collections import deque
from dataclasses import dataclass

from preble_backend.common.fair_share import ServiceWeights, TenantShares
from preble_backend.serving.protocol import RATE_LIMITED, BadRequest

_MINUTE = 60.0


class RateLimited(BadRequest):
    """A tenant over its tokens_per_minute: the router answers "retry", fronts 429."""


@dataclass
class Bucket:
    tokens: float
    at: float
    per_minute: int

    def refill(self, now: float) -> None:
        self.tokens = min(float(self.per_minute), self.tokens + (now - self.at) * self.per_minute / _MINUTE)
        self.at = now


class TokenBudgets:
    def __init__(self, clock=time.monotonic, source: str = "") -> None:
        self.clock = clock
        self.source = source or f"router@{uuid.uuid4().hex[:8]}"
        self.buckets: dict[str, Bucket] = {}
        self.spent = TenantShares(service_weights=ServiceWeights(1.0, 1.0, 1.0))  # tenant -> router -> tokens
        self._heard: dict[str, float] | None = None  # tenant -> the other routers' tokens taken so far
        self._early: dict[str, deque[tuple[float, float]]] = {}  # others' spending, no bucket here yet
        self._lock = threading.Lock()  # prompts are taken on the tokenizer threads, outputs on the loop

    def _bucket(self, tenant: str, per_minute: int) -> Bucket:
        """``tenant``'s bucket at this moment; a new one has what the others spent in the
        last minute taken from it."""
        now = self.clock()
        bucket = self.buckets.get(tenant)
        if bucket is None or bucket.per_minute != per_minute:  # a new cap (the keys file changed)
            bucket = self.buckets[tenant] = Bucket(float(per_minute), now - _MINUTE, per_minute)
            for when, tokens in self._early.pop(tenant, ()):
                if when >= bucket.at:  # older spending has refilled already
                    bucket.refill(when)
                    bucket.tokens -= tokens
        bucket.refill(now)
        return bucket

    def admit(self, tenant: str, per_minute: int, prompt_tokens: int) -> None:
        """Take a request's prompt tokens; raise ``RateLimited`` instead while ``tenant``'s
        bucket is empty (``per_minute`` 0: no cap)."""
        if not per_minute:
            return
        with self._lock:
            bucket = self._bucket(tenant, per_minute)
            if bucket.tokens <= 0:
                wait = math.ceil((1 - bucket.tokens) * _MINUTE / per_minute)
                raise RateLimited(f"tenant {tenant} has used its {RATE_LIMITED}{per_minute} (the keys file); "
                                  f"retry in {wait} s")  # fmt: skip
            bucket.tokens -= prompt_tokens
        self.spent.charge(tenant, self.source, computed=prompt_tokens)

    def take(self, tenant: str, per_minute: int, tokens: int) -> None:
        """A request's output tokens, once it ended."""
        if per_minute and tokens:
            with self._lock:
                self._bucket(tenant, per_minute).tokens -= tokens
            self.spent.charge(tenant, self.source, output=tokens)

    def learn(self, counts) -> None:
        """An engine's copy of the tokens every router took (a health answer's
        ``tokens_spent``): what the others took since last heard comes out of the buckets.
        The first copy heard is where counting starts, not spending to take."""
        self.spent.merge(counts)
        others = {t: total - by.get(self.source, 0.0)
                  for t, by in self.spent.snapshot().items() if (total := sum(by.values()))}  # fmt: skip
        with self._lock:
            heard, self._heard = self._heard, others
            if heard is None:
                return
            now = self.clock()
            for tenant, total in others.items():
                new = total - heard.get(tenant, 0.0)
                if new <= 0:
                    continue
                if tenant in self.buckets:
                    self.buckets[tenant].refill(now)
                    self.buckets[tenant].tokens -= new
                else:
                    early = self._early.setdefault(tenant, deque())
                    early.append((now, new))
                    while early and now - early[0][0] > _MINUTE:
                        early.popleft()

    def probe_fields(self) -> dict:
        """What a health probe carries: this router's copy of the counts, when it has any."""
        counts = self.spent.snapshot()
        return {"spent": counts} if counts else {}
