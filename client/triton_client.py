"""A small client for the ``preble`` router over Triton's HTTP generate endpoints and gRPC
streaming, plus the engine models' control operations (stats, abort, cache flush)."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import closing
from dataclasses import dataclass, field

import numpy as np

from preble_backend.common.keys import bearer, grpc_bearer


class PrebleError(RuntimeError):
    """The server answered with an error; the message is the server's."""


@dataclass
class StreamResult:
    text: str = ""
    responses: list[dict] = field(default_factory=list)  # every response's outputs
    final: dict = field(default_factory=dict)  # the last response's outputs


def _json_payload(prompt: str, params: dict | None, **inputs) -> bytes:
    body = {"text_input": prompt, **inputs}
    if params is not None:
        body["sampling_parameters"] = json.dumps(params)
    return json.dumps(body).encode()


class PrebleClient:
    """``api_key``: sent with every request (the server's ``--api-key``, or the admin key
    for the engines' control operations on a server that restricts them)."""

    def __init__(
        self,
        http_url: str = "127.0.0.1:8000",
        grpc_url: str = "127.0.0.1:8001",
        model: str = "preble",
        api_key: str | None = None,
    ):
        self.http_url, self.grpc_url, self.model = http_url, grpc_url, model
        self.api_key = api_key

    # ---- HTTP -----------------------------------------------------------------------------

    def _post(self, path: str, data: bytes, timeout: float):
        req = urllib.request.Request(
            f"http://{self.http_url}{path}", data=data, method="POST", headers=bearer(self.api_key)
        )
        try:
            return urllib.request.urlopen(req, timeout=timeout)
        except urllib.error.HTTPError as exc:
            body = exc.read().decode(errors="replace")
            try:
                message = json.loads(body)["error"]
            except (ValueError, KeyError):
                message = body
            raise PrebleError(message) from None

    def generate(self, prompt: str, params: dict | None = None, timeout: float = 300, **inputs) -> dict:
        """``POST /v2/models/preble/generate``: one JSON answer."""
        with self._post(
            f"/v2/models/{self.model}/generate", _json_payload(prompt, params, **inputs), timeout
        ) as r:
            return json.loads(r.read())

    def generate_raw(self, body: dict | bytes, timeout: float = 300) -> dict:
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        with self._post(f"/v2/models/{self.model}/generate", data, timeout) as r:
            return json.loads(r.read())

    def generate_stream(
        self, prompt: str, params: dict | None = None, timeout: float = 300, **inputs
    ) -> Iterator[dict]:
        """``POST /v2/models/preble/generate_stream``: one event per response (SSE)."""
        inputs.setdefault("stream", True)
        data = _json_payload(prompt, params, **inputs)
        with self._post(f"/v2/models/{self.model}/generate_stream", data, timeout) as r:
            for line in r:
                line = line.decode().strip()
                if line.startswith("data:"):
                    event = json.loads(line[5:])
                    if "error" in event:
                        raise PrebleError(event["error"])
                    yield event

    # ---- gRPC streaming -------------------------------------------------------------------

    def stream_grpc(
        self,
        prompt: str | bytes,
        params: dict | None = None,
        cancel_after: int | None = None,
        timeout: float = 300,
        model: str | None = None,
        **bool_inputs,
    ) -> StreamResult:
        """Stream one request over gRPC; with ``cancel_after=n``, cancel it after n responses."""
        inputs = {
            "text_input": np.array([prompt.encode() if isinstance(prompt, str) else prompt], dtype=np.object_)
        }
        inputs["stream"] = np.array([True])
        if params is not None:
            inputs["sampling_parameters"] = np.array([json.dumps(params).encode()], dtype=np.object_)
        for name, value in bool_inputs.items():
            inputs[name] = np.array([value])
        return self.infer_grpc(inputs, cancel_after=cancel_after, timeout=timeout, model=model)

    def infer_grpc(
        self,
        inputs: dict[str, np.ndarray],
        cancel_after: int | None = None,
        timeout: float = 300,
        model: str | None = None,
        parameters: dict[str, str] | None = None,
        wait_for_ready: bool = False,
    ) -> StreamResult:
        """Send raw tensors (and request ``parameters``) to a decoupled model over a gRPC
        stream; gather its responses. ``wait_for_ready``: a connection that fails to open
        is tried again until ``timeout`` instead of failing the call at once."""
        import grpc

        channel, stub = open_grpc(self.grpc_url)
        out = StreamResult()
        try:
            key = grpc_bearer(self.api_key)
            calls = stream_infer(stub, model or self.model, inputs, timeout, wait_for_ready,
                                 metadata=key, parameters=parameters)  # fmt: skip
            with closing(calls) as responses:
                for outputs, final in responses:
                    if outputs:
                        decoded = {name: _decode(value) for name, value in outputs.items()}
                        out.responses.append(decoded)
                        out.final = decoded
                        text = decoded.get("text_output")
                        out.text += text if isinstance(text, str) else ""
                    if final or (cancel_after is not None and len(out.responses) >= cancel_after):
                        return out  # closing the stream early cancels the request
            raise PrebleError("the server closed the stream before its final response")
        except StreamError as exc:
            raise PrebleError(str(exc)) from None
        except grpc.RpcError as exc:
            raise PrebleError(f"{exc.code().name}: {exc.details()}") from None
        finally:
            channel.close()

    # ---- control ------------------------------------------------------------------------

    def admin(self, op: str, admin_key: str | None, policy: str | None = None, timeout: float = 120) -> dict:
        """The router's admin control request (``router/cluster/admin.py``): ``status``, ``flush``
        (every engine's cache) or ``configure`` (switch to ``policy``, flushed); returns the
        router's state. Sent with the API key like any request, the admin key inside."""
        params = {"preble_admin": op, "preble_admin_key": admin_key or ""}
        if policy is not None:
            params["preble_policy"] = policy
        result = self.infer_grpc({}, timeout=timeout, parameters=params)
        return json.loads(result.final["text_output"])

    def engine_control(self, engine: str, op: str, **fields) -> dict:
        """Run ``stats`` / ``abort`` / ``flush_cache`` on an engine model; return its report.
        A connection whose handshake fails on a busy host is tried again within the call's
        minute (a poll of an engine's stats had failed at once: "tcp handshaker shutdown")."""
        body = np.array([json.dumps({"op": op, **fields}).encode()], dtype=np.object_)
        result = self.infer_grpc({"control": body}, model=engine, timeout=60, wait_for_ready=True)
        return json.loads(result.final["report"])


class StreamError(RuntimeError):
    """The server answered a streamed request with an error; the message is the server's."""


def open_grpc(url: str, asynchronous: bool = False):
    """A channel to a Triton gRPC endpoint (no message size limits) and its stub; a
    ``grpc.aio`` one with ``asynchronous`` (made on the event loop that will use it). A
    server that refused a connection is tried again within a second, not after gRPC's
    default backoff of up to two minutes: a restarted server is reached as soon as it
    listens."""
    import grpc
    from tritonclient.grpc import service_pb2_grpc

    options = [
        ("grpc.max_send_message_length", -1),
        ("grpc.max_receive_message_length", -1),
        ("grpc.initial_reconnect_backoff_ms", 100),
        ("grpc.min_reconnect_backoff_ms", 100),
        ("grpc.max_reconnect_backoff_ms", 1000),
    ]
    channel = (grpc.aio if asynchronous else grpc).insecure_channel(url, options=options)
    return channel, service_pb2_grpc.GRPCInferenceServiceStub(channel)


def stream_infer(
    stub,
    model: str,
    inputs: dict[str, np.ndarray],
    timeout: float | None = None,
    wait_for_ready=False,
    open_calls: set | None = None,
    metadata: tuple[tuple[str, str], ...] = (),
    parameters: dict[str, str] | None = None,
) -> Iterator[tuple[dict[str, np.ndarray], bool]]:
    """One request on its own bidirectional ``ModelStreamInfer`` stream (errors on a shared
    stream would not say which request they belong to): yield each response's outputs and
    whether it is the final one. An error response raises ``StreamError``; a lost server,
    ``grpc.RpcError`` (unless ``wait_for_ready``: then the call waits for the server to
    listen). Closing the generator early cancels the request on the server; so does
    ``cancel()`` on the call, which stays in ``open_calls`` while it streams. ``metadata``:
    gRPC headers (a key, ``access.grpc_bearer``)."""
    message = infer_request(model, inputs)
    for name, value in (parameters or {}).items():
        message.parameters[name].string_param = value
    request = iter([message])
    call = stub.ModelStreamInfer(request, timeout=timeout, wait_for_ready=wait_for_ready, metadata=metadata)
    if open_calls is not None:
        open_calls.add(call)
    try:
        for message in call:
            outputs, final = stream_response(message)
            yield outputs, final
            if final:
                return
    finally:
        call.cancel()  # a no-op once the stream is done; cancels the request otherwise
        if open_calls is not None:
            open_calls.discard(call)


def stream_response(message) -> tuple[dict[str, np.ndarray], bool]:
    """One ``ModelStreamInferResponse``: its outputs and whether it is the final one; an
    error response raises ``StreamError``."""
    from tritonclient.grpc import InferResult

    if message.error_message:
        raise StreamError(message.error_message)
    result = InferResult(message.infer_response)
    outputs = {o.name: result.as_numpy(o.name) for o in message.infer_response.outputs}
    return outputs, message.infer_response.parameters["triton_final_response"].bool_param


def infer_inputs(values: dict[str, object]) -> list:
    """tritonclient ``InferInput``s of shape [1] (strings as BYTES, bools as BOOL), for
    the clients on tritonclient's own (asyncio) API."""
    import tritonclient.grpc as grpcclient
    from tritonclient.utils import np_to_triton_dtype

    inputs = []
    for name, value in values.items():
        array = np.array([value.encode() if isinstance(value, str) else value],
                         dtype=np.object_ if isinstance(value, str) else None)  # fmt: skip
        tensor = grpcclient.InferInput(name, [1], np_to_triton_dtype(array.dtype))
        tensor.set_data_from_numpy(array)
        inputs.append(tensor)
    return inputs


def infer_request(model: str, inputs: dict[str, np.ndarray], parameters: dict[str, str] | None = None):
    """A ``ModelInferRequest`` with raw tensor contents and string ``parameters``, asking for
    an empty final response."""
    from tritonclient.grpc import service_pb2
    from tritonclient.utils import np_to_triton_dtype, serialize_byte_tensor

    request = service_pb2.ModelInferRequest(model_name=model)
    request.parameters["triton_enable_empty_final_response"].bool_param = True
    for name, value in (parameters or {}).items():
        request.parameters[name].string_param = value
    for name, value in inputs.items():
        tensor = request.inputs.add(name=name, datatype=np_to_triton_dtype(value.dtype))
        tensor.shape.extend(value.shape)
        raw = serialize_byte_tensor(value).item() if value.dtype == np.object_ else value.tobytes()
        request.raw_input_contents.append(raw)
    return request


def _decode(array):
    if array is None:
        return None
    flat = array.reshape(-1)
    if array.dtype == np.object_:
        values = [bytes(v).decode("utf-8", errors="replace") for v in flat]
    else:
        values = flat.tolist()
    return values[0] if len(values) == 1 else values
