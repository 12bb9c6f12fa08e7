"""The front: an OpenAI-compatible HTTP server in front of the ``preble`` router
(``/v1/models``, ``/v1/completions`` and ``/v1/chat/completions``, streamed as server-sent
events when asked, ``/health``) and, with ``--triton-http``, Triton's own HTTP API
(``/v2/...``, ``triton_http.py``). Each OpenAI request is one gRPC stream to the router
on a persistent channel, so the router's routing, streaming and cancellation hold as
they do for Triton's own clients; a client that disconnects cancels its stream, and the
router aborts the request in its engine. With an API key (``PREBLE_API_KEY`` in the
environment) every request but a health probe must carry ``Authorization: Bearer
<key>``, and the front sends the key on to the router. With a keys file (``--keys-file``)
each client key names a tenant (``tenant_gate.py``): the front checks the key, names the
request's tenant, and sends the front's own key on.

    python -m preble_backend.frontend.openai_server --router 127.0.0.1:8001 --model-path tiny

``preble serve`` starts it beside tritonserver and stops it with it.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse

from preble_backend.common.keys import ADMIN_KEY_ENV, API_KEY_ENV
from preble_backend.common.settings import MAX_BODY_BYTES
from preble_backend.common.tenants import KeysFileError, TenantKeys
from preble_backend.frontend import responses
from preble_backend.frontend.drain import Drain
from preble_backend.frontend.metrics_federation import federate
from preble_backend.frontend.openai_protocol import (
    OpenAIError,
    Piece,
    RouterCall,
    Served,
    Usage,
    check_model,
    chunk_body,
    completion_body,
    logprobs_body,
    parse_chat,
    parse_completion,
    sse,
    usage_chunk,
)
from preble_backend.frontend.router_stream import Router, collect, merged, open_choices
from preble_backend.frontend.tenant_gate import TenantGate, add_http_gate
from preble_backend.frontend.tool_calls import Tools, ToolStream, chat_turns
from preble_backend.frontend.triton_grpc import Gate, GrpcFront, start_grpc_front
from preble_backend.frontend.triton_http import EngineView, add_triton_routes, bounded_body
from preble_backend.serving.protocol import retry_after

OPEN_PATHS = ("/health", "/v2/health/live", "/v2/health/ready")  # probes need no key
log = logging.getLogger("preble.frontend")


def chat_renderer(model_path: str):
    """The model's chat template (transformers' ``apply_chat_template``), the assistant's
    turn opened; a model without one answers chat requests with a 400 naming it."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_path)
    renders_tools = "tools" in (tokenizer.chat_template or "")

    def render(messages: list[dict], tools: Tools | None = None) -> str:
        if not tokenizer.chat_template:
            raise OpenAIError(400, f"the model at {model_path} has no chat template: use /v1/completions")
        turns = chat_turns(messages, tools, renders_tools)
        schemas = tools.schemas if tools is not None and renders_tools else None
        return tokenizer.apply_chat_template(turns, tools=schemas, tokenize=False, add_generation_prompt=True)

    return render


@dataclass
class TritonSide:
    """Where the front reaches tritonserver's own HTTP and metrics endpoints."""

    http: str  # http://127.0.0.1:port
    metrics: str  # http://127.0.0.1:port/metrics
    max_body_bytes: int = MAX_BODY_BYTES

    @functools.cached_property
    def engines(self) -> EngineView:
        """Whether an engine is up: one view (and one cached scrape) for HTTP and gRPC."""
        return EngineView(self.metrics)


def make_app(router: Router, served: Served, render, triton: TritonSide | None = None, key: str | None = None,
             card: dict | None = None, max_body_bytes: int = MAX_BODY_BYTES,
             tenants: TenantGate | None = None):  # fmt: skip
    """``card``: what ``/v1/models`` says of the model (vLLM's ``root``, ``max_model_len``,
    and its parameters and dtype); a request body over ``max_body_bytes`` is 413 on every
    route. ``tenants``: who each request is served for (a keys file's keys replace ``key``)."""
    tenants = tenants or TenantGate()
    import aiohttp

    session: list[aiohttp.ClientSession] = []

    @asynccontextmanager
    async def lifespan(_app):
        router.open()
        session.append(aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None, sock_connect=5),
                                             auto_decompress=False))  # fmt: skip
        yield
        await session[0].close()
        await router.close()

    app = FastAPI(title="preble OpenAI-compatible API", lifespan=lifespan)
    engines = triton.engines if triton else None
    if triton is not None:
        add_triton_routes(app, triton.http, engines, router.model, triton.max_body_bytes, lambda: session[0],
                          router.drain, key if tenants.keys is not None else None)  # fmt: skip

    add_http_gate(app, key, tenants, OPEN_PATHS)

    @app.exception_handler(OpenAIError)
    async def openai_error(_request, exc: OpenAIError):
        retry = {"Retry-After": retry_after(str(exc))} if exc.status in (429, 503) else None
        return JSONResponse(exc.body(), status_code=exc.status, headers=retry)

    @app.exception_handler(Exception)
    async def server_fault(_request, exc: Exception):  # ours: a 500, in OpenAI's shape, never plain text
        return JSONResponse(OpenAIError(500, f"internal error: {type(exc).__name__}: {exc}").body(),
                            status_code=500)  # fmt: skip

    @app.exception_handler(RequestValidationError)
    async def validation_error(_request, exc):
        return JSONResponse(OpenAIError(400, str(exc)).body(), status_code=400)

    @app.get("/health")
    async def health():
        if not await router.ready():
            raise OpenAIError(503, f"the router model {router.model} at {router.url} is not ready")
        if engines is not None:
            up, why = await engines.serving(session[0])
            if not up:
                raise OpenAIError(503, why)
        return {"status": "ok"}

    cards = {name: {"id": name, "object": "model", "created": 0, "owned_by": "preble", **(card or {}),
                    **({"parent": str(served)} if name != served else {})}
             for name in served.names}  # fmt: skip

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": list(cards.values())}

    @app.get("/v1/models/{name:path}")
    async def one_model(name: str):
        check_model({"model": name}, served)  # another name: 404, as a request for it would be
        return cards[name]

    async def body_of(request: Request) -> dict:
        raw = await bounded_body(request, max_body_bytes)
        if isinstance(raw, Response):
            raise OpenAIError(413, json.loads(raw.body)["error"])
        try:
            body = json.loads(raw)
            json.dumps(body, ensure_ascii=False).encode()  # a lone surrogate ("\ud800") fails here
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise OpenAIError(400, f"the request body is not valid JSON: {exc}") from None
        except RecursionError:
            raise OpenAIError(400, "the request body is not valid JSON: nested too deeply") from None
        except UnicodeEncodeError:
            raise OpenAIError(400, "the request body holds a lone UTF-16 surrogate: not valid text") from None
        if not isinstance(body, dict):
            raise OpenAIError(400, "the request body must be a JSON object")
        return body

    async def answer(call: RouterCall, request: Request):
        call.tenant = request.state.tenant.parameters()
        _warn_ignored(call)
        streams = await open_choices(router, call)
        if call.stream:
            return StreamingResponse(_events(call, served, streams), media_type="text/event-stream")
        return completion_body(call, served, *await collect(streams))

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await answer(parse_completion(await body_of(request), served), request)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await answer(parse_chat(await body_of(request), served, render), request)

    @app.post("/v1/responses")
    async def create_response(request: Request):
        body = await body_of(request)
        chat = responses.chat_body(body)
        call = parse_chat(chat, served, render)
        call.ignored = sorted(set(body) - set(responses.KNOWN))
        call.tenant = request.state.tenant.parameters()
        _warn_ignored(call)
        [pieces] = await open_choices(router, call)
        if call.stream:
            return StreamingResponse(responses.response_events(call, served, body, pieces),
                                     media_type="text/event-stream")  # fmt: skip
        [choice], usage = await collect([pieces])
        return responses.response_object(call, served, body, choice, usage)

    return app


def metrics_app(router_metrics: str, engines: dict[str, str]) -> FastAPI:
    """``/metrics``: the router's server's series and every engine server's, federated
    (``metrics_federation.py``); open to whoever reaches the port, as Triton's own is."""
    import aiohttp
    from fastapi.responses import PlainTextResponse

    session: list[aiohttp.ClientSession] = []

    @asynccontextmanager
    async def lifespan(_app):
        session.append(aiohttp.ClientSession())
        yield
        await session[0].close()

    app = FastAPI(title="preble metrics", lifespan=lifespan)

    @app.get("/metrics")
    async def metrics():
        text = await federate(session[0], router_metrics, engines)
        return PlainTextResponse(text, media_type="text/plain; version=0.0.4")

    return app


def _warn_ignored(call: RouterCall) -> None:
    if call.ignored:
        log.warning("fields present in the request but ignored: %s", ", ".join(call.ignored))


async def _events(call: RouterCall, served: str, streams: list[AsyncIterator[Piece]]):
    usage, offsets = Usage(), [0] * len(streams)
    tools = [ToolStream(call.tools) if call.tools is not None else None for _ in streams]
    for index in range(len(streams)):
        if call.chat:
            yield sse(chunk_body(call, served, None, None, first=True, index=index))
        elif call.echo:
            yield sse(chunk_body(call, served, call.prompt, None, index=index))
            offsets[index] = len(call.prompt)
    try:
        async for index, piece in merged(streams):
            finish = usage.add(piece, index)
            text = tools[index].feed(piece.text) if tools[index] else piece.text
            if text or piece.logprobs:
                logprobs = logprobs_body(call, piece.logprobs, offsets[index])
                offsets[index] += sum(len(t) for t in logprobs["tokens"]) if logprobs and not call.chat else 0
                yield sse(chunk_body(call, served, text, None, logprobs=logprobs, index=index))
            if not piece.final:
                continue
            if tools[index]:
                content, calls = tools[index].finish()
                if content:
                    yield sse(chunk_body(call, served, content, None, index=index))
                if calls:
                    yield sse(chunk_body(call, served, None, None, index=index, tool_calls=calls))
                    finish = "tool_calls" if finish == "stop" else finish
            yield sse(chunk_body(call, served, None, finish, index=index))
        if call.include_usage:
            yield sse(usage_chunk(call, served, usage))
    except OpenAIError as exc:  # after the first token: the stream ends with the error
        yield sse(exc.body())
    yield sse("[DONE]")


def main(argv: list[str] | None = None) -> None:
    import contextlib
    import os
    import signal

    import uvicorn

    from preble_backend.model.model_card import model_card
    from preble_backend.model.pypi_models import resolve

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)  # fmt: skip
    parser.add_argument("--router", default="127.0.0.1:8001", help="the router's tritonserver gRPC endpoint")
    parser.add_argument("--router-model", default="preble", help="the router model's name")
    parser.add_argument("--model-path", default="tiny", help="the engines' model (its chat template)")
    parser.add_argument("--model-name", default="", help="the model as the repository names it")
    parser.add_argument("--dtype", default="auto", help="the engines' dtype, as /v1/models reports it")
    parser.add_argument(
        "--served-model-name",
        default="",
        help="the name answers carry (none: the model's); 'preble' is always accepted too",
    )
    parser.add_argument("--host", default="127.0.0.1", help="the address to listen on")
    parser.add_argument("--port", type=int, default=9000, help="the OpenAI API's port (0: none)")
    parser.add_argument("--http-port", type=int, default=0, help="Triton's HTTP API's port (0: none)")
    parser.add_argument(
        "--grpc-port",
        type=int,
        default=0,
        help="Triton's gRPC API's port, relayed to --router (0: none; needs --triton-metrics)",
    )
    parser.add_argument("--triton-http", default="", help="tritonserver's own HTTP endpoint, host:port")
    parser.add_argument("--triton-metrics", default="", help="tritonserver's metrics endpoint, host:port")
    parser.add_argument(
        "--metrics-port",
        type=int,
        default=0,
        help="the federated metrics' port: the router server's and every engine's (0: none)",
    )
    parser.add_argument("--engine-metrics", default="", help="name=host:port,...: each engine's metrics")
    parser.add_argument("--max-body-bytes", type=int, default=MAX_BODY_BYTES, help="larger requests: 413")
    parser.add_argument("--keys-file", default="", help="client keys naming tenants (common/tenants.py); "
                        "the front then sends tritonserver its own key, PREBLE_API_KEY")  # fmt: skip
    parser.add_argument("--drain-timeout", type=float, default=30.0, help="SIGTERM: time open requests get")
    args = parser.parse_args(argv)
    key = os.environ.get(API_KEY_ENV) or None
    try:
        tenants = TenantGate(TenantKeys.load(args.keys_file) if args.keys_file else None)
    except KeysFileError as exc:
        parser.exit(2, f"preble front: {exc}\n")
    triton = None
    if args.triton_http:
        triton = TritonSide(f"http://{args.triton_http}", f"http://{args.triton_metrics}/metrics",
                            args.max_body_bytes)  # fmt: skip
    drain = Drain(args.drain_timeout)
    router = Router(args.router, args.router_model, key, drain)
    path = resolve(args.model_path)
    info = model_card(args.model_name or args.model_path, path, args.dtype)
    served = Served(args.served_model_name or info.name, aliases=(args.router_model,))
    card = {"root": info.path, "max_model_len": info.max_model_len, "parameters": info.parameters,
            "active_parameters": info.active_parameters, "architecture": info.architecture,
            "kv_bytes_per_token": info.kv_bytes_per_token, "dtype": info.dtype,
            "served_by": info.served_by}  # fmt: skip
    app = drain.wrap(make_app(router, served, chat_renderer(path), triton, key, card, args.max_body_bytes,
                              tenants))  # fmt: skip
    ports = [p for p in (args.port, args.http_port) if p]
    configs = [uvicorn.Config(app, host=args.host, port=p, log_level="warning", timeout_graceful_shutdown=5)
               for p in ports]  # fmt: skip
    if args.metrics_port and triton is not None:
        engines = dict(entry.split("=", 1) for entry in args.engine_metrics.split(",") if entry)
        urls = {name: f"http://{where}/metrics" for name, where in engines.items()}
        metrics = metrics_app(triton.metrics, urls)
        configs.append(uvicorn.Config(metrics, host=args.host, port=args.metrics_port, log_level="warning",
                                      timeout_graceful_shutdown=5))  # fmt: skip
    servers = [uvicorn.Server(config) for config in configs]
    for server in servers:  # one handler stops both (each server's own would replace the other's)
        server.capture_signals = contextlib.nullcontext
    grpc_front = None
    if args.grpc_port and triton is not None:
        gate = Gate(key, os.environ.get(ADMIN_KEY_ENV) or None, tenants)
        grpc_front = GrpcFront(args.router, gate, triton.engines, args.router_model, drain)

    async def serve_all() -> None:
        grpc_server = None
        if grpc_front is not None:
            grpc_server = await start_grpc_front(grpc_front, args.host, args.grpc_port, args.max_body_bytes)

        async def drain_then_exit() -> None:
            await drain.drain()
            if grpc_server is not None:
                await grpc_server.stop(1)
            for server in servers:
                server.should_exit = True

        def stop() -> None:
            if not drain.draining:
                asyncio.get_running_loop().create_task(drain_then_exit())

        for sig in (signal.SIGINT, signal.SIGTERM):
            asyncio.get_running_loop().add_signal_handler(sig, stop)
        await asyncio.gather(*(server.serve() for server in servers))

    asyncio.run(serve_all())


if __name__ == "__main__":
    main()
