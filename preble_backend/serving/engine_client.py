"""How the router reaches an engine: BLS for engines in the same tritonserver, gRPC
streaming for engines on other servers (``grpc://host:port/model``, one persistent
channel per server, a stream per request). Both stream ``EngineResponse``s and take the
same control operations."""

from __future__ import annotations

import json
from abc import ABC, abstractmethod
from collections.abc import Iterator
from contextlib import closing
from dataclasses import dataclass

import numpy as np

from client.triton_client import StreamError, open_grpc, stream_infer
from preble_backend.serving.protocol import ENGINE_OUTPUTS, names

OUTPUTS = names(ENGINE_OUTPUTS)


class EngineError(RuntimeError):
    """The engine refused or failed the request; the message is the engine's."""


class EngineUnavailable(EngineError):
    """The engine cannot be reached: its process died, or its server went away."""


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
    if all(v is None for v in outputs.values()):
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
        logprobs=None if logprobs is None else [
            {t: (lp, rank) for t, lp, rank in step} for step in json.loads(text(logprobs))
        ],
    )


class EngineClient(ABC):
    def __init__(self, name: str) -> None:
        self.name = name

    @abstractmethod
    def _call(self, inputs: dict[str, np.ndarray]) -> Iterator[dict[str, np.ndarray | None]]:
        """Send one request; yield each response's outputs; raise EngineError on error."""

    def generate(
        self, request_id: str, input_ids: list[int], params_json: str, events_since: str = ""
    ) -> Iterator[EngineResponse]:
        inputs = {
            "input_ids": np.asarray(input_ids, dtype=np.int32),
            "sampling_parameters": np.array([params_json.encode()], dtype=np.object_),
            "request_id": np.array([request_id.encode()], dtype=np.object_),
            "events_since": np.array([events_since.encode()], dtype=np.object_),
        }
        for outputs in self._call(inputs):
            resp = _response(outputs)
            if resp is not None:
                yield resp

    def control(self, op: str, **fields) -> str:
        """Run a control operation; return the engine's report (JSON)."""
        body = json.dumps({"op": op, **fields}).encode()
        report = None
        for outputs in self._call({"control": np.array([body], dtype=np.object_)}):
            resp = _response(outputs)
            if resp is not None and resp.report is not None:
                report = resp.report
        if report is None:
            raise EngineError(f"engine {self.name} sent no report for control op {op!r}")
        return report

    def abort(self, request_id: str) -> None:
        self.control("abort", request_id=request_id)

    def health(self) -> dict:
        """The engine loop's answer to a ``health`` probe (its load snapshot and pid); it
        drains no cache events, which belong to the reports on final responses."""
        return json.loads(self.control("health"))["load"]

    def close(self) -> None:
        """Release connections (remote engines)."""


class LocalEngine(EngineClient):
    """An engine model in this tritonserver, called through decoupled BLS."""

    def _call(self, inputs):
        import triton_python_backend_utils as pb_utils

        request = pb_utils.InferenceRequest(
            model_name=self.name,
            requested_output_names=list(OUTPUTS),
            inputs=[pb_utils.Tensor(k, v) for k, v in inputs.items()],
        )
        error = None
        # Read the decoupled iterator to its end even after an error: leaving it half-read
        # (a final, possibly empty, response still pending) is not safe in 2.51's stub.
        for response in request.exec(decoupled=True):
            if response.has_error():
                error = error or response.error().message()
                if "is not healthy" in error:  # the stub process is gone (Triton's words)
                    raise EngineUnavailable(f"engine {self.name}: {error}")
            elif error is None:
                yield {name: _output(pb_utils, response, name) for name in OUTPUTS}
        if error is not None:
            raise EngineError(error)


def _output(pb_utils, response, name: str):
    tensor = pb_utils.get_output_tensor_by_name(response, name)
    return tensor.as_numpy() if tensor is not None else None


class RemoteEngine(EngineClient):
    """An engine model on another tritonserver: one gRPC channel per engine, kept for the
    router's life, and a stream per request on it. A lost server fails the stream at once
    with UNAVAILABLE; the channel reconnects by itself when it is back."""

    def __init__(self, url: str, model: str) -> None:
        super().__init__(f"grpc://{url}/{model}")
        self.url, self.model = url, model
        self._channel = None
        self._stub = None

    def _call(self, inputs):
        import grpc

        if self._stub is None:
            self._channel, self._stub = open_grpc(self.url)
        try:
            with closing(stream_infer(self._stub, self.model, inputs)) as responses:
                for outputs, final in responses:
                    yield {name: outputs.get(name) for name in OUTPUTS}
                    if final:
                        return
            raise EngineUnavailable(f"engine {self.name} closed the stream before its final response")
        except StreamError as exc:
            raise EngineError(str(exc)) from None
        except grpc.RpcError as exc:
            reason = f"{exc.code().name}: {exc.details()}"
            raise EngineUnavailable(f"engine {self.name} is unreachable: {reason}") from None

    def close(self) -> None:
        if self._channel is not None:
            self._channel.close()


def make_engine_clients(spec: str) -> list[EngineClient]:
    """Parse the router's ``engines`` parameter: comma-separated local model names and
    ``grpc://host:port/model`` remotes."""
    clients: list[EngineClient] = []
    for entry in (e.strip() for e in spec.split(",")):
        if not entry:
            continue
        if entry.startswith("grpc://"):
            rest = entry.removeprefix("grpc://")
            url, _, model = rest.partition("/")
            if not model or ":" not in url:
                raise ValueError(f"engines entry {entry!r} is invalid: expected grpc://host:port/model")
            clients.append(RemoteEngine(url, model))
        elif "://" in entry:
            raise ValueError(f"engines entry {entry!r} is invalid: only grpc:// remotes are supported")
        else:
            clients.append(LocalEngine(entry))
    if not clients:
        raise ValueError("engines='' is invalid: expected at least one engine model name or grpc:// URL")
    return clients
