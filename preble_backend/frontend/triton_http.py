"""Triton's HTTP API, served by the front instead of by tritonserver itself.

Why not tritonserver's own listener: Triton 2.51's HTTP server dies with SIGSEGV on a
request body of 4 MiB or more sent as ``application/x-www-form-urlencoded`` (what
``curl -d`` sends), so one request could end every client's stream. Here tritonserver's
HTTP listener is on loopback at a port only the front knows, and the front passes each
request on with a bounded body and a JSON content type (binary-tensor requests keep
theirs), streaming the answer back as it comes. On the way it:

- answers readiness honestly: the server and the router model are ready only while the
  router is loaded and at least one engine takes requests (Triton would report ready
  with every engine dead), read from the router's ``preble_router_engine_up`` gauges;
- answers "retry" as retryable: the router's at-capacity and no-engine refusals, which
  Triton's HTTP server sends as 400, become 503 with ``Retry-After``.
"""

from __future__ import annotations

import asyncio
import json
import re
import time

import aiohttp
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from preble_backend.frontend.drain import MESSAGE, Drain
from preble_backend.serving.admin import FORBIDDEN
from preble_backend.serving.protocol import retryable

HOP_BY_HOP = {"connection", "keep-alive", "transfer-encoding", "te", "trailer", "upgrade", "host",
              "content-length", "proxy-authorization", "proxy-connection"}  # fmt: skip
BINARY = "inference-header-content-length"  # Triton's binary tensor extension: the body is not JSON
ENGINE_UP = re.compile(r"^preble_router_engine_up\{[^}]*\}\s+([0-9.eE+-]+)", re.MULTILINE)
RETRY_AFTER_S = "1"
MODEL_CONTROL = re.compile(r"^repository/models/[^/]+/(load|unload)$")
NO_MODEL_CONTROL = ("loading and unloading models is disabled: the servers run with model control 'none' "
                    "(the router's admin control request switches its policy; docs/SECURITY.md)")  # fmt: skip
MAX_DEPTH = 512  # fewer brackets than this: no nesting to fear
DRAIN_LIMIT_BYTES = 1 << 30  # an oversized body is read and dropped up to this, then cut


class EngineView:
    """Whether the router has an engine that takes requests, from its gauges on Triton's
    metrics endpoint; cached briefly, as load balancers probe often."""

    def __init__(self, metrics_url: str, ttl_s: float = 0.5) -> None:
        self.metrics_url, self.ttl_s = metrics_url, ttl_s
        self._at, self._value = 0.0, (False, "not checked yet")

    async def serving(self, session) -> tuple[bool, str]:
        if time.monotonic() - self._at < self.ttl_s:
            return self._value
        try:
            async with session.get(self.metrics_url) as resp:
                text = await resp.text()
            values = [float(v) for v in ENGINE_UP.findall(text)]
            if not values:
                value = (False, "the router reports no engines (is it loaded?)")
            elif max(values) < 1:
                value = (False, "no engine is available: every engine has failed")
            else:
                value = (True, f"{sum(v >= 1 for v in values)} engine(s) up")
        except Exception as exc:  # the server is gone or starting: not ready
            value = (False, f"tritonserver's metrics are unreachable: {exc}")
        self._at, self._value = time.monotonic(), value
        return value


def add_triton_routes(app: FastAPI, upstream: str, engines: EngineView, router_model: str,
                      max_body_bytes: int, session_of, drain: Drain) -> None:  # fmt: skip
    """Mount ``/v2/...`` on ``app``, forwarded to tritonserver's HTTP at ``upstream``
    (``http://127.0.0.1:port``); ``session_of()``: the app's ``aiohttp`` session."""

    async def ready_answer(path: str) -> Response | None:
        """The honest answer to a readiness probe of the server or the router model."""
        if path not in ("health/ready", f"models/{router_model}/ready"):
            return None
        session = session_of()
        try:
            async with session.get(f"{upstream}/v2/{path}") as resp:
                if resp.status != 200:
                    return Response(status_code=resp.status, content=await resp.read())
        except aiohttp.ClientError as exc:
            return _unreachable(exc)
        up, why = await engines.serving(session)
        return Response(status_code=200) if up else JSONResponse({"error": why}, status_code=503)

    @app.api_route("/v2", methods=["GET"])
    @app.api_route("/v2/{path:path}", methods=["GET", "POST"])
    async def forward(request: Request, path: str = ""):
        if request.method == "GET" and (answer := await ready_answer(path)) is not None:
            return answer
        if MODEL_CONTROL.match(path):  # Triton's own answer blames "polling", and is a 503
            return JSONResponse({"error": NO_MODEL_CONTROL}, status_code=403)
        body = await _bounded_body(request, max_body_bytes)
        if isinstance(body, Response):
            return body
        headers = {k: v for k, v in request.headers.items() if k.lower() not in HOP_BY_HOP}
        binary = BINARY in {k.lower() for k in headers}
        if not binary and (refusal := await _too_deep(body)) is not None:
            return refusal
        if not binary:
            headers = {k: v for k, v in headers.items() if k.lower() != "content-type"}
            headers["content-type"] = "application/json"
        session = session_of()
        target = f"{upstream}/v2/{path}" if path else f"{upstream}/v2"
        call = asyncio.ensure_future(session.request(request.method, target, params=request.query_params,
                                                     data=body, headers=headers))  # fmt: skip
        drain.upstreams.add(call)  # waiting for the first response, the drain's cut must reach it
        try:
            resp = await call
        except asyncio.CancelledError:
            if not drain.cutting or asyncio.current_task().cancelling():
                raise
            return JSONResponse({"error": MESSAGE}, status_code=503, headers={"Retry-After": RETRY_AFTER_S})
        except aiohttp.ClientConnectionError as exc:  # the router's server is restarting, say
            return _unreachable(exc)
        finally:
            drain.upstreams.discard(call)
        kept = {k: v for k, v in resp.headers.items() if k.lower() not in HOP_BY_HOP}
        if resp.status != 200:
            content = await resp.read()
            resp.release()
            return _retryable(resp.status, content, kept)
        if "text/event-stream" not in resp.headers.get("content-type", ""):
            content = await resp.read()
            resp.release()
            return Response(content, status_code=200, headers=kept)
        drain.upstreams.add(resp)
        try:
            first = await resp.content.readline()
        except Exception:
            if not drain.cutting:
                raise
            first = b""
        if first.startswith(b"data: {\"error\"") and retryable(first.decode(errors="replace")):
            drain.upstreams.discard(resp)
            resp.close()  # refused before its first token: an HTTP error a client can retry on
            return _retryable(400, first[len(b"data: "):].strip(), {})

        async def relay():
            try:
                yield first
                async for chunk in resp.content.iter_any():
                    yield chunk
            except Exception:
                if not drain.cutting:
                    raise
            finally:
                drain.upstreams.discard(resp)
                resp.close()  # a client that left: closing tritonserver's stream cancels it
            if drain.cutting:
                yield b"data: " + json.dumps({"error": MESSAGE}).encode() + b"\n\n"

        return StreamingResponse(relay(), status_code=200, headers=kept)


async def _bounded_body(request: Request, limit: int) -> bytes | Response:
    """The body, or 413 once it passes ``limit``. An oversized body is still read (and
    dropped), up to a bound, so that a client which sends all of it before it reads the
    answer gets the 413 rather than a reset connection."""
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            chunks = []
            if size > DRAIN_LIMIT_BYTES:
                break
        else:
            chunks.append(chunk)
    return _too_large(size, limit) if size > limit else b"".join(chunks)


async def _too_deep(body: bytes) -> Response | None:
    """400 for JSON nested deeper than Python's parser goes (about a thousand levels):
    tritonserver 2.51's parser recurses without a limit, and a body nested 100,000 deep
    killed it (SIGSEGV). Bodies with few brackets cannot be deep and are not parsed here."""
    if body.count(b"[") + body.count(b"{") < MAX_DEPTH:
        return None
    try:
        await asyncio.get_running_loop().run_in_executor(None, json.loads, body)
    except RecursionError:
        message = "the request body is not valid JSON: nested too deeply"
        return JSONResponse({"error": message}, status_code=400)
    except ValueError:
        pass  # not JSON at all: tritonserver says so
    return None


def _unreachable(exc: Exception) -> Response:
    message = f"the router's tritonserver is unreachable ({type(exc).__name__}); retry later"
    return JSONResponse({"error": message}, status_code=503, headers={"Retry-After": RETRY_AFTER_S})


def _too_large(size: int, limit: int) -> Response:
    message = f"the request body ({size} bytes or more) is over the limit of {limit} bytes (--max-body-bytes)"
    return JSONResponse({"error": message}, status_code=413)


def _retryable(status: int, content: bytes, headers: dict[str, str]) -> Response:
    """Triton's error answer, as 503 with ``Retry-After`` when the router said "retry", and
    as 400 when Triton calls a body it cannot parse a 500 of its own."""
    try:
        message = str(json.loads(content).get("error", ""))
    except (ValueError, AttributeError):
        message = ""
    if status == 400 and retryable(message):
        return JSONResponse({"error": message}, status_code=503, headers={"Retry-After": RETRY_AFTER_S})
    if status == 400 and message.startswith(FORBIDDEN):
        return JSONResponse({"error": message}, status_code=403)
    if status == 500 and message.startswith("failed to parse the request JSON"):
        return JSONResponse({"error": message}, status_code=400)
    return Response(content, status_code=status, headers=headers)
