"""Requests that took engines down with them, refused for a while.

A request whose engine dies while it runs continues on another (``migration_limit``
times, once by default). If that engine dies too, the request is the likely cause: two
engine deaths under one request is rare by chance, and certain when the request itself
crashes what serves it (a grammar that overflowed the compiler's stack did exactly that,
and each migration carried it to the next engine). It then fails with an error its client
does not retry, and an identical request (same prompt, same parameters) is refused for
``poison_ttl_s``: a retrying client would otherwise take every engine down in turn. The
entry expires, because a router cannot prove the request guilty, only suspect it.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable

MAX_ENTRIES = 1024


class Quarantine:
    def __init__(self, ttl_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.ttl_s, self.clock = ttl_s, clock
        self.until: dict[str, float] = {}  # fingerprint -> when it may be served again

    @staticmethod
    def fingerprint(prompt: str, params_json: str) -> str:
        digest = hashlib.sha256(prompt.encode(errors="surrogatepass"))
        digest.update(b"\0" + params_json.encode(errors="surrogatepass"))
        return digest.hexdigest()

    def add(self, prompt: str, params_json: str) -> None:
        now = self.clock()
        self.until = {k: t for k, t in self.until.items() if t > now}
        if len(self.until) >= MAX_ENTRIES:  # the oldest entry goes first
            self.until.pop(min(self.until, key=self.until.__getitem__))
        self.until[self.fingerprint(prompt, params_json)] = now + self.ttl_s

    def refusal(self, prompt: str, params_json: str) -> str | None:
        """Why this request is refused now, or None."""
        if not self.until:
            return None
        left = self.until.get(self.fingerprint(prompt, params_json), 0.0) - self.clock()
        if left <= 0:
            return None
        return (f"this request is refused for {left:.0f} s more: an identical one was running on each of "
                "the engines that failed under it (poison_ttl_s)")  # fmt: skip
