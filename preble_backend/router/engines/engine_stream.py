"""One gRPC stream per engine carrying every request the router sends it.

Triton's ``ModelStreamInfer`` takes any number of requests on one call and answers each
with responses that carry the request's ``id`` (errors included). Against the do-nothing
relay of ``benchmarks/relay_floor.py`` at 40 requests/s, a call per request cost its client and
the server ~0.75 ms of CPU per request more than one long-lived call (the router: 6-12%,
docs/benchmarks/serving.md), so the router keeps one call per engine, writes each request to it
and hands each response to the request it names. A reader task owns the call; when the
call ends (the engine's server went away, or ``cancel``), every request still open on it
fails with ``StreamClosed`` and the next request opens a new call.

A request has no gRPC call of its own to cancel: one whose reader stops before its final
response (the router's task ended early) sends the engine an ``abort`` control request on
the same stream, as the router does for a client that went away.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import AsyncIterator

import numpy as np

from client.triton_client import infer_request, stream_response


class StreamClosed(RuntimeError):
    """The engine's stream ended: its server went away, or the router cancelled it."""


_ENDED = object()  # the reader's last word to each open request: see ``_closed_reason``


class EngineStream:
    """Made and used on the router's event loop only."""

    def __init__(self, stub, model: str, wait_for_ready: bool, metadata: tuple) -> None:
        self.model = model
        self._outbox: asyncio.Queue = asyncio.Queue()
        self._open: dict[str, asyncio.Queue] = {}  # request id -> its responses
        self._ids = itertools.count()
        self._closed_reason: BaseException | None = None
        self._call = stub.ModelStreamInfer(self._requests(), wait_for_ready=wait_for_ready, metadata=metadata)
        self._reader = asyncio.get_running_loop().create_task(self._read())

    @property
    def closed(self) -> bool:
        return self._closed_reason is not None

    def __len__(self) -> int:
        return len(self._open)

    async def _requests(self):
        while (request := await self._outbox.get()) is not None:
            yield request

    async def _read(self) -> None:
        try:
            async for message in self._call:
                responses = self._open.get(message.infer_response.id)
                if responses is not None:  # else an abort's answer, or a request that gave up
                    responses.put_nowait(message)
            self._closed_reason = StreamClosed("the engine ended the stream")
        except asyncio.CancelledError:
            self._closed_reason = StreamClosed("CANCELLED: its streams were cancelled")
        except Exception as exc:  # grpc.aio.AioRpcError: the server went away
            self._closed_reason = exc
        finally:
            if self._closed_reason is None:
                self._closed_reason = StreamClosed("the stream's reader stopped")
            for responses in self._open.values():
                responses.put_nowait(_ENDED)

    async def request(
        self, inputs: dict[str, np.ndarray], abort: dict[str, np.ndarray] | None = None,
        parameters: dict[str, str] | None = None,
    ) -> AsyncIterator[tuple[dict[str, np.ndarray], bool]]:  # fmt: skip
        """Send one request; yield each response's (outputs, final). ``abort``: the
        control inputs to send if the caller stops reading before the final response."""
        if self.closed:
            raise self._closed_reason
        request_id = f"r{next(self._ids)}"
        responses = self._open[request_id] = asyncio.Queue()
        request = infer_request(self.model, inputs, parameters)
        request.id = request_id
        self._outbox.put_nowait(request)
        finished = False  # by its final response, an error response, or the stream's end
        try:
            while True:
                message = await responses.get()
                if message is _ENDED:
                    finished = True
                    raise self._closed_reason
                try:
                    outputs, final = stream_response(message)
                except Exception:  # an error response ends the request
                    finished = True
                    raise
                finished = final
                yield outputs, final
                if final:
                    return
        finally:
            del self._open[request_id]
            if not finished and abort is not None and not self.closed:
                cancel = infer_request(self.model, abort)
                cancel.id = f"a{next(self._ids)}"
                self._outbox.put_nowait(cancel)

    def cancel(self) -> None:
        """End the call (on the loop): every open request fails with ``StreamClosed``, and
        the next request opens a new call."""
        if self._closed_reason is None:
            self._closed_reason = StreamClosed("CANCELLED: its streams were cancelled")
        self._call.cancel()
        self._outbox.put_nowait(None)
