"""How ``preble bench`` talks to a server: the router over Triton's gRPC streaming or
HTTP server-sent events, or one engine directly (``--direct``). Each transport fills an
``Outcome`` as the answer streams in (first token, tokens, cached tokens, the engine)."""

from __future__ import annotations

import itertools
import json
import time

import numpy as np

from client.bench_config import BenchConfig, BenchRequest, Outcome
from client.triton_client import PrebleClient, infer_inputs
from preble_backend.common.keys import bearer, grpc_bearer


def flush_engine(url: str, engine: str) -> None:
    """Empty ``engine``'s prefix cache before a direct run. A server that does not host it
    is named as such: ``preble serve`` runs each engine on a tritonserver of its own,
    behind the stack's engine key, which no client holds."""
    try:
        PrebleClient(grpc_url=url).engine_control(engine, "flush_cache")
    except Exception as exc:
        if "Request for unknown model" not in str(exc):
            raise
        raise ValueError(
            f"--direct {engine}: the server at {url} does not host that engine model. A `preble serve` "
            "stack runs each engine on a tritonserver of its own, behind the stack's engine key, out of a "
            "client's reach; --direct needs a server that hosts the engine model beside the router "
            "(tritonserver --model-repository over a `preble repo` directory)"
        ) from exc


def _sampling(req: BenchRequest) -> str:
    return json.dumps({"max_tokens": req.max_tokens, "temperature": 0, "ignore_eos": True})


def _tokens_arrived(out: Outcome, now: float, n: int) -> None:
    if n and out.first_token is None:
        out.first_token = now
    out.output_tokens += n


class GrpcRouter:
    """The router over Triton's gRPC streaming (the vLLM backend's inputs)."""

    def __init__(self, cfg: BenchConfig) -> None:
        import tritonclient.grpc.aio as grpcaio

        self.client, self.model = grpcaio.InferenceServerClient(cfg.url), cfg.model
        self.headers = dict(grpc_bearer(cfg.api_key))

    def inputs(self, req: BenchRequest) -> list:
        return infer_inputs({"text_input": req.prompt, "stream": True, "sampling_parameters": _sampling(req),
                             "exclude_input_in_output": True, "return_num_input_tokens": True,
                             "return_num_output_tokens": True})  # fmt: skip

    def arrived(self, result, names: set[str], out: Outcome, now: float) -> None:
        if "num_output_tokens" in names:
            _tokens_arrived(out, now, int(result.as_numpy("num_output_tokens").reshape(-1)[0]))
        if "num_input_tokens" in names:
            out.input_tokens = int(result.as_numpy("num_input_tokens").reshape(-1)[0])
        if "instance" in names:
            out.instance = bytes(result.as_numpy("instance").reshape(-1)[0]).decode()

    async def __call__(self, req: BenchRequest, out: Outcome, start: float) -> None:
        async def one():
            yield {"model_name": self.model, "inputs": self.inputs(req),
                   "parameters": {"triton_enable_empty_final_response": True}}  # fmt: skip

        async for result, error in self.client.stream_infer(one(), headers=self.headers):
            if error is not None:
                out.error = error.message() if hasattr(error, "message") else str(error)
                return
            response = result.get_response()
            names = {o.name for o in response.outputs}
            self.arrived(result, names, out, time.monotonic() - start)
            if "num_cached_tokens" in names:
                out.cached_tokens = int(result.as_numpy("num_cached_tokens").reshape(-1)[0])
            if response.parameters["triton_final_response"].bool_param:
                out.finished = time.monotonic() - start
                return

    async def close(self) -> None:
        await self.client.close()


class GrpcEngine(GrpcRouter):
    """One engine addressed directly (``--direct``): token ids in and out, no router. It
    reads the engine's cache events from where the last answer left off, as a router
    would, so no answer carries a snapshot of the whole cache."""

    def __init__(self, cfg: BenchConfig) -> None:
        super().__init__(cfg)
        self.log_id, self.next_event = "", 0  # where in the engine's event log to read on

    def inputs(self, req: BenchRequest) -> list:
        import tritonclient.grpc as grpcclient

        ids = grpcclient.InferInput("input_ids", [len(req.input_ids)], "INT32")
        ids.set_data_from_numpy(np.array(req.input_ids, dtype=np.int32))
        cursor = f"{self.log_id}/{self.next_event}" if self.log_id else ""
        rest = infer_inputs({"sampling_parameters": _sampling(req), "events_since": cursor})
        return [ids, *rest]

    async def __call__(self, req: BenchRequest, out: Outcome, start: float) -> None:
        out.input_tokens, out.instance = len(req.input_ids), self.model
        await super().__call__(req, out, start)

    def arrived(self, result, names: set[str], out: Outcome, now: float) -> None:
        if "token_ids" in names:
            _tokens_arrived(out, now, int(result.as_numpy("token_ids").size))
        if "report" in names:
            log = json.loads(bytes(result.as_numpy("report").reshape(-1)[0]).decode()).get("log")
            if log:  # [log id, first, next, snapshot]: read on after the furthest ``next``
                log_id, _, next_event, _ = log
                if log_id != self.log_id or next_event > self.next_event:
                    self.log_id, self.next_event = log_id, next_event


class SseRouter:
    """The router over HTTP: Triton's ``generate_stream``, server-sent events."""

    def __init__(self, cfg: BenchConfig) -> None:
        import aiohttp

        # One connection per request in flight, as that many separate clients would hold.
        connector = aiohttp.TCPConnector(limit=0)
        self.session = aiohttp.ClientSession(
            connector=connector, timeout=aiohttp.ClientTimeout(total=None), headers=bearer(cfg.api_key)
        )
        self.endpoint = f"http://{cfg.http_url}/v2/models/{cfg.model}/generate_stream"

    async def __call__(self, req: BenchRequest, out: Outcome, start: float) -> None:
        body = {"text_input": req.prompt, "stream": True, "sampling_parameters": _sampling(req),
                "exclude_input_in_output": True, "return_num_input_tokens": True,
                "return_num_output_tokens": True}  # fmt: skip
        async with self.session.post(self.endpoint, json=body) as resp:
            if resp.status != 200:
                out.error = f"HTTP {resp.status}: {(await resp.text())[:200]}"
                return
            async for line in resp.content:
                if not line.startswith(b"data:"):
                    continue
                event = json.loads(line[5:])
                if "error" in event:
                    out.error = str(event["error"])
                    return
                now = time.monotonic() - start
                _tokens_arrived(out, now, int(_scalar(event.get("num_output_tokens", 0))))
                out.input_tokens = int(_scalar(event.get("num_input_tokens", out.input_tokens)))
                out.cached_tokens = int(_scalar(event.get("num_cached_tokens", out.cached_tokens)))
                out.instance = str(_scalar(event.get("instance", out.instance)))
        out.finished = time.monotonic() - start  # the stream ends with the last response

    async def close(self) -> None:
        await self.session.close()


def _scalar(value):
    """Triton's JSON gives a one-element tensor as a list or as the element."""
    return value[0] if isinstance(value, list) else value


TRANSPORTS = {"grpc": GrpcRouter, "sse": SseRouter}


class Spread:
    """Requests to router replicas in turn, as a Service in front of them spreads them:
    each request chooses anew, so a conversation's turns may meet different routers."""

    def __init__(self, makers: list) -> None:
        self.routers = [make() for make in makers]
        self._turn = itertools.count()

    async def __call__(self, req: BenchRequest, out: Outcome, start: float) -> None:
        await self.routers[next(self._turn) % len(self.routers)](req, out, start)

    async def close(self) -> None:
        for router in self.routers:
            await router.close()
