"""How the router reaches an engine: one gRPC stream per engine carrying every request
(``engine_stream.py``), over persistent channels per engine, to its own tritonserver's
endpoint for an engine in the same server and to ``grpc://host:port/model`` for one on
another server. Both stream ``EngineResponse``s (asynchronously, on the router's event
loop) and take the same control operations."""

from __future__ import annotations

import asyncio
import ipaddress
import json
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import aclosing, closing, contextmanager
from dataclasses import dataclass

import numpy as np

from client.triton_client import StreamError, open_grpc, stream_infer
from preble_backend.common.keys import engine_key, grpc_bearer
from preble_backend.router.engines.engine_stream import EngineStream, StreamClosed
from preble_backend.serving.protocol import ENGINE_OUTPUTS, REFUSED, names, not_loaded

OUTPUTS = names(ENGINE_OUTPUTS)


class EngineError(RuntimeError):
    """The engine refused or failed the request; the message is the engine's."""


class EngineUnavailable(EngineError):
    """The engine cannot be reached: its process died, or its server went away."""


class EngineRefused(EngineError):
    """The engine refused the request as one it can never serve; the message is why."""


@dataclass(frozen=True)
class EngineResponse:
    token_ids: list[int]
    final: bool
    finish_reason: str | None = None
    num_cached_tokens: int = 0
    report: str | None = None
    logprobs: list[dict[int, tuple[float, int]]] | None = None  # per token, when asked for


def _response(outputs: dict[str, np.ndarray | None]) -> EngineResponse | None:
    """Decode one engine response; an empty one (a bare final flag) gives None."""
    if all(outputs.get(name) is None for name in OUTPUTS):
        return None
    tokens = outputs.get("token_ids")
    reason = outputs.get("finish_reason")
    cached = outputs.get("num_cached_tokens")
    report = outputs.get("report")
    logprobs = outputs.get("logprobs")

    def text(a):
        return None if a is None else bytes(a.reshape(-1)[0]).decode()

    return EngineResponse(
        token_ids=[] if tokens is None else tokens.reshape(-1).tolist(),
        final=reason is not None,
        finish_reason=text(reason),
        num_cached_tokens=0 if cached is None else int(cached.reshape(-1)[0]),
        report=text(report),
        logprobs=None
        if logprobs is None
        else [{t: (lp, rank) for t, lp, rank in step} for step in json.loads(text(logprobs))],
    )


class EngineClient:
    """An engine model behind a gRPC endpoint: two channels per engine, kept for the
    router's life. Requests go on one long-lived stream of a ``grpc.aio`` channel
    (``engine_stream.py``), all of them on the router's one event loop (made there at
    first use); control operations (the monitor's health
    probes, tools) are blocking calls on a plain channel. Both reconnect by themselves
    when the server is back. Every call carries the engine key (``PREBLE_ENGINE_KEY``)
    when the router has one: engines serve only the router."""

    wait_for_ready = False  # a server that does not listen fails the call at once
    on_this_host = False  # whether its GPUs are this host's (the router samples them through NVML)

    def __init__(self, url: str, model: str, name: str) -> None:
        self.url, self.model, self.name = url, model, name
        self.metadata = grpc_bearer(engine_key())
        self._channel, self._stub = open_grpc(url)  # connects on first use
        self._open_calls: set = set()  # blocking calls in flight (set.add/discard hold the GIL)
        self._aio = None  # (channel, stub, loop), made on the event loop at its first stream
        self._stream_call: EngineStream | None = None  # every request's, on the event loop only

    # ---- streams, on the router's event loop ----------------------------------------------

    async def _stream(
        self, inputs: dict[str, np.ndarray], abort: dict[str, np.ndarray] | None = None,
        parameters: dict[str, str] | None = None,
    ) -> AsyncIterator[dict[str, np.ndarray]]:  # fmt: skip
        """Send one request on the engine's stream; yield each response's outputs; raise
        EngineError on error. ``abort``: what to send if the reader stops early."""
        if self._aio is None:
            self._aio = (*open_grpc(self.url, asynchronous=True), asyncio.get_running_loop())
        if self._stream_call is None or self._stream_call.closed:
            self._stream_call = EngineStream(self._aio[1], self.model, self.wait_for_ready, self.metadata)
        with self._errors():
            try:
                async with aclosing(self._stream_call.request(inputs, abort, parameters)) as responses:
                    async for outputs, final in responses:
                        yield outputs
                        if final:
                            return
            except StreamClosed as exc:
                raise EngineUnavailable(f"engine {self.name} is unreachable: {exc}") from None
        raise EngineUnavailable(f"engine {self.name} closed the stream before its final response")

    async def generate(
        self, request_id: str, input_ids: list[int], params_json: str, events_since: str = "",
        kv: dict | None = None, tenant: dict[str, str] | None = None,
    ) -> AsyncIterator[EngineResponse]:  # fmt: skip
        """``kv``: a prefill leg's ``{"offer": true}``, or a decode's ``{"take": offer}``;
        ``tenant``: the request parameters naming whose share it is served from."""
        inputs = {
            "input_ids": np.asarray(input_ids, dtype=np.int32),
            "sampling_parameters": np.array([params_json.encode()], dtype=np.object_),
            "request_id": np.array([request_id.encode()], dtype=np.object_),
            "events_since": np.array([events_since.encode()], dtype=np.object_),
        }
        if kv is not None:
            inputs["kv_transfer"] = np.array([json.dumps(kv).encode()], dtype=np.object_)
        abort = _control_inputs("abort", request_id=request_id)
        async with aclosing(self._stream(inputs, abort, tenant)) as stream:
            async for outputs in stream:
                resp = _response(outputs)
                if resp is not None:
                    yield resp

    async def abort(self, request_id: str) -> None:
        """Abort a request in the engine (its stream then ends with a final response)."""
        async with aclosing(self._stream(_control_inputs("abort", request_id=request_id))) as stream:
            async for _ in stream:
                pass

    # ---- blocking control operations, any thread ------------------------------------------

    def control(self, op: str, **fields) -> str:
        """Run a control operation; return the engine's report (JSON)."""
        report = None
        with self._errors():
            calls = stream_infer(self._stub, self.model, _control_inputs(op, **fields),
                                 wait_for_ready=self.wait_for_ready, open_calls=self._open_calls,
                                 metadata=self.metadata)  # fmt: skip
            with closing(calls) as responses:
                for outputs, _ in responses:
                    resp = _response(outputs)
                    if resp is not None and resp.report is not None:
                        report = resp.report
        if report is None:
            raise EngineError(f"engine {self.name} sent no report for control op {op!r}")
        return report

    def health(self, **fields) -> dict:
        """The engine loop's answer to a ``health`` probe (its load snapshot and pid); it
        drains no cache events, which belong to the reports on final responses. ``fields``
        go with the probe (``shares``: the router's copy of the tenants' service)."""
        return json.loads(self.control("health", **fields))["load"]

    def cancel_all(self) -> int:
        """Cancel every call in flight to this engine, streams and control calls; return
        how many (any thread). A dead engine answers none of them: a request left waiting
        on one would hold its client's request, and with it the router model, which then
        never unloads (and tritonserver never exits, waiting for the router's open
        streams)."""
        calls = list(self._open_calls)
        for call in calls:
            call.cancel()
        streams = 0
        if self._aio is not None and not self._aio[2].is_closed():
            stream = self._stream_call
            streams = len(stream) if stream is not None else 0  # a racy read: for the caller's log only
            if stream is not None:
                self._aio[2].call_soon_threadsafe(stream.cancel)
        return len(calls) + streams

    @contextmanager
    def _errors(self) -> Iterator[None]:
        """The engine's error responses as EngineError, a lost connection (or a cancelled
        call) as EngineUnavailable."""
        import grpc

        try:
            yield
        except StreamError as exc:
            message = str(exc)
            if message.startswith(REFUSED):
                raise EngineRefused(message.removeprefix(REFUSED)) from None
            if not_loaded(message):  # its server is up, the model not (yet): the request moves
                raise EngineUnavailable(f"engine {self.name} is unavailable: {message}") from None
            raise EngineError(message) from None
        except grpc.RpcError as exc:
            reason = f"{exc.code().name}: {exc.details()}"
            raise EngineUnavailable(f"engine {self.name} is unreachable: {reason}") from None

    def close(self) -> None:
        """Close the blocking channel (the streaming one closes on its loop: ``aclose``)."""
        self._channel.close()

    async def aclose(self) -> None:
        if self._aio is not None:
            await self._aio[0].close()

    def reopen_streams(self) -> None:
        """Stream on a fresh channel from now on (on the event loop). An engine's server
        that was restarted is reached at once by a new channel, while the old one may still
        sit out its reconnect backoff and fail a stream at once with UNAVAILABLE — which
        would mark the engine down again just after it came back."""
        if self._aio is not None and not self._aio[2].is_closed():
            channel, self._aio, self._stream_call = self._aio[0], None, None
            asyncio.get_running_loop().create_task(channel.close())


def _control_inputs(op: str, **fields) -> dict[str, np.ndarray]:
    return {"control": np.array([json.dumps({"op": op, **fields}).encode()], dtype=np.object_)}


class RemoteEngine(EngineClient):
    """An engine model on another tritonserver (``grpc://host:port/model``): a lost server
    fails the stream at once with UNAVAILABLE."""

    def __init__(self, url: str, model: str, name: str | None = None) -> None:
        super().__init__(url, model, name or f"grpc://{url}/{model}")
        self.on_this_host = _is_loopback(url.rpartition(":")[0].strip("[]"))


def _is_loopback(host: str) -> bool:
    """``preble serve``'s own engine servers are at a loopback address: their GPUs are this
    host's, so the router samples them through NVML."""
    try:
        return host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name
        return False


class LocalEngine(EngineClient):
    """An engine model in the router's own tritonserver, reached over that server's gRPC
    endpoint. Not through decoupled BLS: in Triton 2.51's Python backend, the responses of
    a decoupled BLS call are freed on the stub's cleanup thread without the GIL whenever
    Python has let go of them first, and their numpy arrays' deallocation then corrupts
    the router's heap (numpy's "Reference count error ... dtype 17 (O)", then SIGSEGV;
    fixed upstream after 2.51, in python_backend #390). It also held one of the
    instance's 32 backend threads until the engine's first response.

    A call waits for the endpoint to listen: the router's own server is serving (it sent
    the request), and the endpoint may start a moment after its models loaded."""

    wait_for_ready = True
    on_this_host = True

    def __init__(self, model: str, server_url: str) -> None:
        super().__init__(server_url, model, model)


def parse_engine_entry(entry: str) -> tuple[str | None, str | None, str]:
    """One ``engines`` entry: a model name in this server, or a ``[name=]grpc://host:port/model``
    remote (``name`` is how responses and metrics call it; ``preble serve`` names its own
    engine servers so). Gives (name, host:port or None for a local engine, model)."""
    name, _, target = entry.rpartition("=") if "=grpc://" in entry else ("", "", entry)
    if target.startswith("grpc://"):
        url, _, model = target.removeprefix("grpc://").partition("/")
        if not model or ":" not in url:
            raise ValueError(f"engines entry {entry!r} is invalid: expected [name=]grpc://host:port/model")
        return name or None, url, model
    if "://" in entry or not entry or "=" in entry:
        raise ValueError(f"engines entry {entry!r} is invalid: only grpc:// remotes are supported")
    return None, None, entry


def make_engine_client(entry: str, server_url: Callable[[], str]) -> EngineClient:
    """The client for one entry; ``server_url()`` (this server's gRPC endpoint) is asked
    only for a local engine."""
    name, url, model = parse_engine_entry(entry)
    return LocalEngine(model, server_url()) if url is None else RemoteEngine(url, model, name)
