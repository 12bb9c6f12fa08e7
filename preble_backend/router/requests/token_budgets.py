"""Each tenant's ``tokens_per_minute`` (the keys file's option), kept by one router: a token
bucket per tenant that holds a minute's tokens and refills continuously. A request is
refused while its tenant's bucket is empty; its prompt tokens are taken when it is
tokenized and its output tokens when it ends, so a request is never cut off for a cap
it passed at admission (a bucket may go below zero, and the tenant then waits longer).
Like ``max_in_flight`` at the fronts, the cap is per router: with several routers a tenant
may have that many tokens through each.
"""

from __future__ import annotations

import math
import threading
import time
from dataclasses import dataclass

from preble_backend.serving.protocol import RATE_LIMITED, BadRequest


class RateLimited(BadRequest):
    """A tenant over its tokens_per_minute: the router answers "retry", fronts 429."""


@dataclass
class Bucket:
    tokens: float
    at: float


class TokenBudgets:
    def __init__(self, clock=time.monotonic) -> None:
        self.clock = clock
        self.buckets: dict[str, Bucket] = {}
        self._lock = threading.Lock()  # prompts are taken on the tokenizer threads, outputs on the loop

    def _bucket(self, tenant: str, per_minute: int) -> Bucket:
        now = self.clock()
        bucket = self.buckets.setdefault(tenant, Bucket(float(per_minute), now))
        bucket.tokens = min(float(per_minute), bucket.tokens + (now - bucket.at) * per_minute / 60.0)
        bucket.at = now
        return bucket

    def admit(self, tenant: str, per_minute: int, prompt_tokens: int) -> None:
        """Take a request's prompt tokens; raise ``RateLimited`` instead while ``tenant``'s
        bucket is empty (``per_minute`` 0: no cap)."""
        if not per_minute:
            return
        with self._lock:
            bucket = self._bucket(tenant, per_minute)
            if bucket.tokens <= 0:
                wait = math.ceil((1 - bucket.tokens) * 60.0 / per_minute)
                raise RateLimited(f"tenant {tenant} has used its {RATE_LIMITED}{per_minute} (the keys file); "
                                  f"retry in {wait} s")  # fmt: skip
            bucket.tokens -= prompt_tokens

    def take(self, tenant: str, per_minute: int, tokens: int) -> None:
        """A request's output tokens, once it ended."""
        if per_minute and tokens:
            with self._lock:
                self._bucket(tenant, per_minute).tokens -= tokens
