"""Graceful drain of the front on SIGTERM: refuse new requests (503 with ``Retry-After``;
health probes answer 503, so a load balancer stops sending), let open ones finish until
the drain deadline, then end each one still open with a message its client reads ("the
server is shutting down") and exit.

``Drain`` wraps the ASGI app, so a request counts as open until its last byte is sent
(a streamed answer outlives the endpoint that returned it). The streams register the
upstream call they read from (an aiohttp response, a gRPC stream); cutting closes those,
and each stream turns the closed upstream into its closing error message.
"""

from __future__ import annotations

import asyncio
import json
import time

MESSAGE = "the server is shutting down"
HEALTH = ("/health", "/v2/health/ready")


class Drain:
    """The app's wrapper (``wrap``) and the streams' registry of upstream calls."""

    def __init__(self, deadline_s: float = 30.0) -> None:
        self.app, self.deadline_s = None, deadline_s
        self.open = 0
        self.draining = False
        self.cutting = False
        self.upstreams: set = set()  # what each open stream reads from: ``close()``/``cancel()``

    def cut_this_task(self) -> bool:
        """Whether the ``CancelledError`` being handled is the drain's cut of this task's
        upstream (answer the client with the drain's message), not this task's own
        cancellation (its client left: re-raise)."""
        return self.cutting and not asyncio.current_task().cancelling()

    def wrap(self, app) -> Drain:
        self.app = app
        return self

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if self.draining:
            await _refuse(scope, send)
            return
        self.open += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.open -= 1

    async def drain(self) -> None:
        """Refuse from now on; wait for the open requests until the deadline; cut the rest."""
        self.draining = True
        deadline = time.monotonic() + self.deadline_s
        while self.open and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if self.open:
            self.cutting = True
            for upstream in list(self.upstreams):
                (getattr(upstream, "cancel", None) or upstream.close)()
            end = time.monotonic() + 5  # the streams send their closing message
            while self.open and time.monotonic() < end:
                await asyncio.sleep(0.05)


async def _refuse(scope, send) -> None:
    path = scope.get("path", "")
    if path.startswith("/v1/"):
        error = {"message": MESSAGE, "type": "service_unavailable", "param": None, "code": 503}
        body = json.dumps({"error": error}).encode()
    else:
        body = json.dumps({"error": MESSAGE if path not in HEALTH else f"not ready: {MESSAGE}"}).encode()
    headers = [(b"content-type", b"application/json"), (b"retry-after", b"1"),
               (b"content-length", str(len(body)).encode()), (b"connection", b"close")]  # fmt: skip
    await send({"type": "http.response.start", "status": 503, "headers": headers})
    await send({"type": "http.response.body", "body": body})
