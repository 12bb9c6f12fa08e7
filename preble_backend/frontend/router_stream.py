"""The front's client of the ``preble`` router: each OpenAI request's choices as gRPC
streams on one persistent channel (Triton's vLLM-backend contract), their responses as
``Piece``s, and the router's errors as OpenAI errors. A stream that ends early (the
client went away, an error) is cancelled, and the router aborts the request in its
engine."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator

from preble_backend.common.keys import grpc_bearer
from preble_backend.frontend.drain import MESSAGE, Drain
from preble_backend.frontend.openai_protocol import Choice, OpenAIError, Piece, RouterCall, Usage
from preble_backend.serving.protocol import invalid, rate_limited, retryable


def router_error(message: str) -> OpenAIError:
    """The router's error as an OpenAI error: 429 when the tenant is over its
    tokens_per_minute, 503 when it is at capacity or has no engine to serve it (retry), 400
    when it refused the request, 500 otherwise."""
    if rate_limited(message):
        return OpenAIError(429, message)
    if retryable(message):
        return OpenAIError(503, message)
    if invalid(message):
        return OpenAIError(400, message)
    return OpenAIError(500, message)


class Router:
    """The router's gRPC endpoint: one channel, a stream per request. The channel is
    opened inside the server's event loop (``open``), which it is bound to."""

    def __init__(self, url: str, model: str = "preble", key: str | None = None, drain: Drain | None = None):
        self.url, self.model = url, model
        self.headers = dict(grpc_bearer(key))
        self.drain = drain or Drain()
        self.client = None

    def open(self) -> None:
        import tritonclient.grpc.aio as grpcaio

        self.client = grpcaio.InferenceServerClient(self.url)

    async def ready(self) -> bool:
        try:
            return await self.client.is_model_ready(self.model, headers=self.headers)
        except Exception:
            return False

    async def generate(self, call: RouterCall, choice: int = 0,
                       engine: str | None = None) -> AsyncIterator[Piece]:  # fmt: skip
        """Choice ``choice`` of the call (a seeded call's choice i samples with seed + i),
        on ``engine`` when it is named and up."""
        from client.triton_client import infer_inputs

        params = call.params
        if choice and params.get("seed") is not None:
            params = {**params, "seed": int(params["seed"]) + choice}
        inputs = infer_inputs({
            "text_input": call.prompt, "stream": True, "sampling_parameters": json.dumps(params),
            "exclude_input_in_output": True, "return_finish_reason": True,
            "return_num_input_tokens": True, "return_num_output_tokens": True,
            "return_logprobs": call.logprobs is not None,
        })  # fmt: skip

        parameters = {"triton_enable_empty_final_response": True, **call.tenant}
        if engine:
            parameters["preble_engine"] = engine

        async def one():
            yield {"model_name": self.model, "inputs": inputs, "parameters": parameters}

        try:
            responses = self.client.stream_infer(one(), headers=self.headers)
        except Exception as exc:
            raise OpenAIError(503, f"the router at {self.url} is unreachable: {exc}") from None
        done = False
        self.drain.upstreams.add(responses)
        try:
            async for result, error in responses:
                if error is not None:
                    raise router_error(error.message())
                final = result.get_response().parameters["triton_final_response"].bool_param
                yield _piece(result, final)
                if final:
                    done = True
                    return
            raise OpenAIError(500, "the router closed the stream before its final response")
        except OpenAIError:
            raise
        except asyncio.CancelledError:  # how grpc.aio ends a call the drain's deadline cancelled
            if not self.drain.cut_this_task():
                raise
            raise OpenAIError(503, MESSAGE) from None
        except Exception as exc:  # the channel broke
            raise OpenAIError(503, f"the router at {self.url} failed: {exc}") from None
        finally:
            self.drain.upstreams.discard(responses)
            if not done:
                responses.cancel()  # the client went away, or an error: the router aborts the request

    async def close(self) -> None:
        await self.client.close()


def _piece(result, final: bool) -> Piece:
    def value(name):
        array = result.as_numpy(name)
        return None if array is None or array.size == 0 else array.reshape(-1)[0]

    text = value("text_output")
    reason = value("finish_reason")
    steps = value("logprobs")
    engine = value("instance")
    return Piece(
        text=text.decode("utf-8") if isinstance(text, bytes) else "",
        output_tokens=int(value("num_output_tokens") or 0),
        final=final,
        finish_reason=reason.decode() if isinstance(reason, bytes) and reason else None,
        prompt_tokens=int(value("num_input_tokens") or 0),
        cached_tokens=int(value("num_cached_tokens") or 0),
        logprobs=(json.loads(steps) or []) if isinstance(steps, bytes) else [],  # "null": not asked
        engine=engine.decode() if isinstance(engine, bytes) else None,
    )


async def open_choices(router: Router, call: RouterCall) -> list[AsyncIterator[Piece]]:
    """The call's ``n`` answer streams. The first is awaited to its first token before the
    others start: an error before any token is still an HTTP error, and the others, pinned
    to the first's engine, find the prompt in its cache (one prefill for ``n`` choices)."""
    first = router.generate(call)
    piece = await anext(first)

    async def whole():
        yield piece
        async for rest in first:
            yield rest

    return [whole(), *(router.generate(call, i, piece.engine) for i in range(1, call.n))]


async def merged(streams: list[AsyncIterator[Piece]]) -> AsyncIterator[tuple[int, Piece]]:
    """(choice, piece) from every stream as they come; the first error ends them all."""
    if len(streams) == 1:
        async for piece in streams[0]:
            yield 0, piece
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(index: int, pieces: AsyncIterator[Piece]) -> None:
        try:
            async for piece in pieces:
                await queue.put((index, piece))
        except Exception as exc:
            await queue.put((index, exc))
        await queue.put((index, None))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        open_streams = len(streams)
        while open_streams:
            index, item = await queue.get()
            if item is None:
                open_streams -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield index, item
    finally:
        for task in tasks:
            task.cancel()


async def collect(streams: list[AsyncIterator[Piece]]) -> tuple[list[Choice], Usage]:
    """Every choice's whole answer, and the usage."""
    choices, usage = [Choice() for _ in streams], Usage()
    async for index, piece in merged(streams):
        choice = choices[index]
        choice.text += piece.text
        choice.steps.extend(piece.logprobs)
        choice.finish = usage.add(piece, index) or choice.finish
    return choices, usage
