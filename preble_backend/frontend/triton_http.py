"""Triton's HTTP API, served by the front instead of by tritonserver itself.

Why not tritonserver's own listener: Triton 2.51's HTTP server dies with SIGSEGV on a
request body of 4 MiB or more sent as ``application/x-www-form-urlencoded`` (what
``curl -d`` sends), or with a binary-tensor header and a form body, or on JSON nested
100,000 deep, so one request could end every client's stream. Here tritonserver's HTTP
listener is on loopback at a port only the front knows, and the front parses every
request and writes it anew (``_canonical``: canonical JSON, known headers only, a body
bounded on every route), streaming the answer back as it comes. On the way it:

- answers readiness honestly: the server and the router model are ready only while the
  router is loaded and at least one engine takes requests (Triton would report ready
  with every engine dead), read from the router's ``preble_router_engine_up`` gauges;
- answers "retry" as retryable: the router's at-capacity and no-engine refusals, which
  Triton's HTTP server sends as 400, become 503 with ``Retry-After``;
- ends a stream whose upstream died with an error event, never as a clean finish.
"""

from __future__ import annotations

import asyncio
import json
import re
import time

import aiohttp
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from preble_backend.common.keys import bearer
from preble_backend.common.version import __version__
from preble_backend.frontend.drain import MESSAGE, Drain
from preble_backend.serving.protocol import FORBIDDEN, rate_limited, retry_after, retryable

HOP_BY_HOP = {"connection", "keep-alive", "transfer-encoding", "te", "trailer", "upgrade", "host",
              "content-length", "proxy-authorization", "proxy-connection"}  # fmt: skip
FORWARDED = {"authorization", "accept"}  # of a client's request headers, the ones tritonserver gets
BINARY = "inference-header-content-length"  # Triton's binary tensor extension: the body is not JSON
ENGINE_UP = re.compile(r"^preble_router_engine_up\{[^}]*\}\s+([0-9.eE+-]+)", re.MULTILINE)
RETRY_AFTER_S = "1"
CLOSE = {"Connection": "close"}
GENERATE = re.compile(r"^models/(?P<model>[^/]+)(?:/versions/[^/]+)?/(?P<kind>generate|generate_stream)$")
ROUTER_FLAGS = ("stream", "exclude_input_in_output", "return_finish_reason", "return_cumulative_logprob",
                "return_logprobs", "return_num_input_tokens", "return_num_output_tokens")  # fmt: skip
INFERENCE = re.compile(r"^models/[^/]+(?:/versions/[^/]+)?/(?:infer|generate|generate_stream)$")
MODEL_CONTROL = re.compile(r"^repository/models/[^/]+/(load|unload)$")
NO_MODEL_CONTROL = ("loading and unloading models is disabled: the servers run with model control 'none' "
                    "(the router's admin control request switches its policy; docs/SECURITY.md)")  # fmt: skip
DRAIN_LIMIT_BYTES = 256 << 20  # an oversized body is read and dropped up to this, then cut


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


def add_triton_routes(
    app: FastAPI,
    upstream: str,
    engines: EngineView,
    router_model: str,
    max_body_bytes: int,
    session_of,
    drain: Drain,
    upstream_key: str | None = None,
) -> None:
    """Mount ``/v2/...`` on ``app``, forwarded to tritonserver's HTTP at ``upstream``
    (``http://127.0.0.1:port``); ``session_of()``: the app's ``aiohttp`` session. With
    ``upstream_key`` (a keys file names tenants), tritonserver gets that key, not the
    client's, and every inference request its tenant's parameters (``request.state.tenant``)."""

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

    async def server_metadata() -> Response:
        """Triton's server metadata with this release's version beside it."""
        try:
            async with session_of().get(f"{upstream}/v2") as resp:
                if resp.status != 200:
                    return Response(status_code=resp.status, content=await resp.read())
                metadata = await resp.json(content_type=None)
        except aiohttp.ClientError as exc:
            return _unreachable(exc)
        return JSONResponse({**metadata, "preble_version": __version__})

    @app.api_route("/v2", methods=["GET"])
    @app.api_route("/v2/{path:path}", methods=["GET", "POST"])
    async def forward(request: Request, path: str = ""):
        if request.method == "GET" and not path:
            return await server_metadata()
        if request.method == "GET" and (answer := await ready_answer(path)) is not None:
            return answer
        if MODEL_CONTROL.match(path):  # Triton's own answer blames "polling", and is a 503
            return JSONResponse({"error": NO_MODEL_CONTROL}, status_code=403)
        body = await bounded_body(request, max_body_bytes)
        if isinstance(body, Response):
            return body
        tenant = getattr(request.state, "tenant", None)
        parameters = tenant.parameters() if tenant is not None and INFERENCE.match(path) else None
        canonical = await _canonical(request, body, parameters, upstream_key)
        if isinstance(canonical, Response):
            return canonical
        body, headers, parsed = canonical
        if (generate := GENERATE.match(path)) and generate["model"] == router_model and body:
            if (problem := _generate_problem(parsed, generate["kind"])) is not None:
                return _bad(problem)
        session = session_of()
        target = f"{upstream}/v2/{path}" if path else f"{upstream}/v2"
        call = asyncio.ensure_future(session.request(request.method, target, params=request.query_params,
                                                     data=body, headers=headers))  # fmt: skip
        drain.upstreams.add(call)  # waiting for the first response, the drain's cut must reach it
        try:
            resp = await call
        except asyncio.CancelledError:
            if not drain.cut_this_task():
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
        except Exception as exc:
            if not drain.cutting:
                drain.upstreams.discard(resp)
                resp.close()
                return _unreachable(exc)
            first = b""
        refusal = first.decode(errors="replace")
        if first.startswith(b'data: {"error"') and (retryable(refusal) or rate_limited(refusal)):
            drain.upstreams.discard(resp)
            resp.close()  # refused before its first token: an HTTP error a client can retry on
            return _retryable(400, first[len(b"data: ") :].strip(), {})

        async def relay():
            try:
                yield first
                async for chunk in resp.content.iter_any():
                    yield chunk
            except Exception as exc:  # the router's server died: never a clean finish
                if not drain.cutting:
                    yield _event({"error": f"{LOST} ({type(exc).__name__}); the answer is incomplete"})
            finally:
                drain.upstreams.discard(resp)
                resp.close()  # a client that left: closing tritonserver's stream cancels it
            if drain.cutting:
                yield _event({"error": MESSAGE})

        return StreamingResponse(relay(), status_code=200, headers=kept)


async def bounded_body(request: Request, limit: int) -> bytes | Response:
    """The body, or 413 once it passes ``limit``: nothing past the limit is kept or
    parsed. The rest is read and dropped, up to ``DRAIN_LIMIT_BYTES``, so that a client
    which sends all of it before it reads the answer gets the 413 rather than a reset
    connection; a body that says it is larger than that is refused unread."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > DRAIN_LIMIT_BYTES:
        return _too_large(int(declared), limit, close=True)
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            chunks = []
            if size > DRAIN_LIMIT_BYTES:
                break
        else:
            chunks.append(chunk)
    return _too_large(size, limit, close=True) if size > limit else b"".join(chunks)


async def _canonical(
    request: Request, body: bytes, parameters: dict | None = None, upstream_key: str | None = None
) -> tuple[bytes, dict[str, str], object] | Response:
    """The request as tritonserver gets it: parsed here and written anew, with only the
    headers it needs. Nothing a client sends reaches tritonserver's HTTP parser as sent
    (its form-encoded and deep-JSON paths crashed it: docs/SECURITY.md). A JSON body is
    re-serialized; a binary-tensor body keeps its tensor bytes behind a re-serialized
    JSON header whose length is ours. ``parameters`` are written over the request's own;
    ``upstream_key`` replaces the client's. Also returns the parsed JSON (None: no body)."""
    headers = {k: v for k, v in request.headers.items() if k.lower() in FORWARDED}
    if upstream_key is not None:
        headers = {k: v for k, v in headers.items() if k.lower() != "authorization"} | bearer(upstream_key)
    if not body:
        return body, headers, None
    declared = request.headers.get(BINARY)
    if declared is None:
        header, tensors = body, b""
    elif not declared.isdigit() or int(declared) > len(body):
        return _bad(f"header {BINARY}={declared!r} is invalid: expected a byte count within the body's "
                    f"{len(body)}")  # fmt: skip
    else:
        header, tensors = body[: int(declared)], body[int(declared) :]
    try:
        parsed = await asyncio.get_running_loop().run_in_executor(None, json.loads, header)
        if parameters and isinstance(parsed, dict):
            if not isinstance(parsed.get("parameters", {}), dict):
                return _bad("'parameters' must be a JSON object")
            parsed["parameters"] = {**parsed.get("parameters", {}), **parameters}
        encoded = json.dumps(parsed, separators=(",", ":"), allow_nan=False).encode()
    except RecursionError:
        return _bad("the request body is not valid JSON: nested too deeply")
    except ValueError as exc:  # UnicodeDecodeError, a lone surrogate, NaN among them
        return _bad(f"the request body is not valid JSON: {exc}")
    if declared is None:
        return encoded, {**headers, "content-type": "application/json"}, parsed
    binary = {"content-type": "application/octet-stream", BINARY: str(len(encoded))}
    return encoded + tensors, {**headers, **binary}, parsed


LOST = "the router's tritonserver failed mid-stream"


def _event(data: dict) -> bytes:
    return b"data: " + json.dumps(data).encode() + b"\n\n"


def _unreachable(exc: Exception) -> Response:
    message = f"the router's tritonserver is unreachable ({type(exc).__name__}); retry later"
    return JSONResponse({"error": message}, status_code=503, headers={"Retry-After": RETRY_AFTER_S})


def _generate_problem(body, kind: str) -> str | None:
    """What is wrong with a generate request to the router, checked here because
    tritonserver answers a wrongly typed input with a 500 of its own."""
    if not isinstance(body, dict):
        return "the request body must be a JSON object"
    if "text_input" in body and not isinstance(body["text_input"], str):
        return "input 'text_input' must be a string"
    for flag in ROUTER_FLAGS:
        if flag in body and not isinstance(body[flag], bool):
            return f"input '{flag}' must be a boolean (true or false)"
    if "sampling_parameters" in body and not isinstance(body["sampling_parameters"], str):
        return "input 'sampling_parameters' must be a string holding a JSON object"
    if "parameters" in body and not isinstance(body["parameters"], dict):
        return "'parameters' must be a JSON object"
    if kind == "generate" and body.get("stream") is True:
        return "input 'stream' must be false on generate: a streamed answer needs generate_stream"
    return None


def _bad(message: str) -> Response:
    return JSONResponse({"error": message}, status_code=400)


def _too_large(size: int, limit: int, close: bool = False) -> Response:
    message = f"the request body ({size} bytes or more) is over the limit of {limit} bytes (--max-body-bytes)"
    return JSONResponse({"error": message}, status_code=413, headers=CLOSE if close else None)


def _retryable(status: int, content: bytes, headers: dict[str, str]) -> Response:
    """Triton's error answer, as 503 with ``Retry-After`` when the router said "retry", and
    as 400 when Triton calls a body it cannot parse a 500 of its own."""
    try:  # generate_stream's refusals come as one server-sent event: data: {"error": ...}
        message = str(json.loads(content.strip().removeprefix(b"data:")).get("error", ""))
    except (ValueError, AttributeError):
        message = ""
    if rate_limited(message):
        wait = {"Retry-After": retry_after(message)}  # a tenant over its tokens_per_minute
        return JSONResponse({"error": message}, status_code=429, headers=wait)
    if status == 400 and retryable(message):
        return JSONResponse({"error": message}, status_code=503, headers={"Retry-After": RETRY_AFTER_S})
    if status == 400 and message.startswith(FORBIDDEN):
        return JSONResponse({"error": message}, status_code=403)
    if status == 500 and message.startswith("failed to parse the request JSON"):
        return JSONResponse({"error": message}, status_code=400)
    return Response(content, status_code=status, headers=headers)
