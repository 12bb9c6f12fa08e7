"""One gRPC stream per engine carries all of a router's requests to it: responses reach
the request whose id they carry, an error ends only its request, a request abandoned
early sends the engine an abort, and a stream that ends fails the requests open on it. An
error response is classed by what the router must do with its request."""

from __future__ import annotations

import asyncio
import json
import threading
from concurrent.futures import ThreadPoolExecutor

import grpc
import numpy as np
import pytest
from tritonclient.grpc import service_pb2, service_pb2_grpc

from client.triton_client import StreamError, open_grpc
from preble_backend.router.engines.engine_client import (
    EngineError,
    EngineRefused,
    EngineUnavailable,
    LocalEngine,
)
from preble_backend.router.engines.engine_stream import EngineStream, StreamClosed
from preble_backend.serving.protocol import retryable


class Echo(service_pb2_grpc.GRPCInferenceServiceServicer):
    """Answers request ``n`` (its ``input_ids`` hold n) with n responses, the last one
    final; [0] is never answered, [-1] is refused with an error. Records every control
    request it is sent."""

    def __init__(self) -> None:
        self.controls: list[dict] = []
        self.stop = threading.Event()

    def ModelStreamInfer(self, requests, context):  # noqa: N802 (gRPC's name)
        for request in requests:
            names = [t.name for t in request.inputs]
            if "control" in names:
                raw = request.raw_input_contents[names.index("control")]
                self.controls.append(json.loads(raw[4:]))  # a BYTES tensor: 4-byte length, then the text
                continue
            n = int(np.frombuffer(request.raw_input_contents[names.index("input_ids")], np.int32)[0])
            if n < 0:  # Triton names the request an error response is for
                yield service_pb2.ModelStreamInferResponse(
                    error_message="refused: no such thing",
                    infer_response=service_pb2.ModelInferResponse(id=request.id),
                )
                continue
            for k in range(1, n + 1):
                response = service_pb2.ModelInferResponse(id=request.id, model_name="m")
                response.parameters["triton_final_response"].bool_param = k == n
                yield service_pb2.ModelStreamInferResponse(infer_response=response)
            if self.stop.is_set():
                return


@pytest.fixture
def echo():
    servicer, server = Echo(), grpc.server(ThreadPoolExecutor(4))
    service_pb2_grpc.add_GRPCInferenceServiceServicer_to_server(servicer, server)
    url = f"127.0.0.1:{server.add_insecure_port('127.0.0.1:0')}"
    server.start()
    yield servicer, url
    server.stop(0)


def ids(n: int) -> dict[str, np.ndarray]:
    return {"input_ids": np.array([n], dtype=np.int32)}


ABORT = {"control": np.array([json.dumps({"op": "abort", "request_id": "x"}).encode()], dtype=np.object_)}


def test_one_stream_carries_many_requests(echo):
    servicer, url = echo

    async def run():
        channel, stub = open_grpc(url, asynchronous=True)
        stream = EngineStream(stub, "m", False, ())

        async def count(n: int) -> int:
            return sum([1 async for _ in stream.request(ids(n))])

        assert await asyncio.gather(*(count(n) for n in (3, 1, 5, 2))) == [3, 1, 5, 2]
        with pytest.raises(StreamError, match="refused: no such thing"):
            await count(-1)
        assert await count(2) == 2 and len(stream) == 0  # the error ended only its request
        abandoned = stream.request(ids(0), ABORT)  # never answered: the reader gives up
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(abandoned.__anext__(), 0.3)
        await abandoned.aclose()
        await asyncio.sleep(0.3)
        assert servicer.controls == [{"op": "abort", "request_id": "x"}]
        finished = stream.request(ids(2), ABORT)
        assert [final async for _, final in finished] == [False, True]
        waiting = asyncio.ensure_future(count(0))
        await asyncio.sleep(0.2)
        stream.cancel()
        with pytest.raises(StreamClosed, match="CANCELLED"):
            await waiting
        assert stream.closed and servicer.controls == [{"op": "abort", "request_id": "x"}]
        with pytest.raises(StreamClosed):
            await count(1)
        fresh = EngineStream(stub, "m", False, ())
        assert sum([1 async for _ in fresh.request(ids(2))]) == 2
        fresh.cancel()
        await channel.close()

    asyncio.run(run())


def test_a_server_that_goes_away_fails_the_open_requests(echo):
    servicer, url = echo

    async def run():
        channel, stub = open_grpc(url, asynchronous=True)
        stream = EngineStream(stub, "m", False, ())
        servicer.stop.set()  # the server ends the call after its next answer
        assert sum([1 async for _ in stream.request(ids(1))]) == 1
        await asyncio.sleep(0.2)
        with pytest.raises(StreamClosed, match="ended the stream"):
            async for _ in stream.request(ids(1)):
                pass
        await channel.close()

    asyncio.run(run())


@pytest.mark.parametrize(
    ("message", "kind"),
    [
        ("[request id: r8] Server is stopping, scheduler for model has stopped accepting new inference "
         "requests", EngineUnavailable),  # its server stopped after its stub died: the request moves
        ("Request for unknown model: 'e0' is not found", EngineUnavailable),
        ("Stub process 'e0' is not healthy.", EngineUnavailable),
        ("refused: the prompt is 9000 tokens, over the context of 8192", EngineRefused),
        ("the forward pass failed: CUDA error", EngineError),
    ],
)  # fmt: skip
def test_an_engines_error_response_is_classed_by_what_the_router_must_do(message, kind):
    """Triton's answers for a model that is not serving move the request to another engine
    (and a front answers them 503); an engine's refusal is the client's error; any other
    failure is the engine's."""
    engine = LocalEngine("e0", "127.0.0.1:1")
    with pytest.raises(EngineError) as raised, engine._errors():
        raise StreamError(message)
    assert type(raised.value) is kind
    assert retryable(str(raised.value)) == (kind is EngineUnavailable)
    engine.close()
