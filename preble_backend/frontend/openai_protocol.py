"""OpenAI's ``/v1/completions`` and ``/v1/chat/completions`` requests mapped onto the
router's contract (Triton's vLLM-backend inputs), and the router's answers and errors in
OpenAI's shapes. Free of HTTP and gRPC: the server (``openai_server``) moves the bytes.

Sampling follows vLLM's OpenAI server: OpenAI's keys (``max_tokens``, or
``max_completion_tokens`` for chat; ``temperature``, ``top_p``, ``stop``, ``seed``,
``presence_penalty``, ``frequency_penalty``) and vLLM's extras (``top_k``,
``min_tokens``, ``repetition_penalty``, ``ignore_eos``, ``stop_token_ids``); logprobs of
the sampled tokens as OpenAI returns them (completions: ``logprobs: k``; chat:
``logprobs: true`` and ``top_logprobs: k``). What the engine cannot do (``n`` > 1,
``best_of``, ``logit_bias``, ``suffix``, tools, a ``response_format`` other than text) is
refused, naming the field.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field

from preble_backend.common.sampling_params import SamplingParams

SAMPLING_KEYS = (
    "temperature", "top_p", "stop", "seed", "presence_penalty", "frequency_penalty",
    "top_k", "min_tokens", "repetition_penalty", "ignore_eos", "stop_token_ids",
)  # fmt: skip
OTHER_KEYS = (  # read by the parsers or checked by _check_unsupported (``user``: ignored)
    "model", "stream", "stream_options", "user", "messages", "prompt", "echo", "max_tokens",
    "max_completion_tokens", "n", "best_of", "logit_bias", "suffix", "response_format",
    "tools", "tool_choice", "logprobs", "top_logprobs", "parallel_tool_calls",
)  # fmt: skip
DEFAULT_MAX_TOKENS = 16  # OpenAI's and vLLM's default for completions


ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
               503: "service_unavailable"}  # fmt: skip


class OpenAIError(Exception):
    """An error answered in OpenAI's shape: ``{"error": {"message", "type", "param", "code"}}``."""

    def __init__(self, status: int, message: str, param: str | None = None, kind: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param = status, message, param
        self.kind = kind or ERROR_TYPES.get(status, "internal_error")

    def body(self) -> dict:
        error = {"message": self.message, "type": self.kind, "param": self.param, "code": self.status}
        return {"error": error}


def bad_request(message: str, param: str | None = None) -> OpenAIError:
    return OpenAIError(400, message, param)


@dataclass
class RouterCall:
    """One request for the router: the prompt text and its sampling parameters."""

    prompt: str
    params: dict
    stream: bool = False
    include_usage: bool = False
    echo: bool = False
    chat: bool = False
    logprobs: int | None = None  # alternatives per token, when logprobs are asked for
    ignored: list[str] = field(default_factory=list)  # fields this server does not know (logged)
    id: str = field(default_factory=lambda: uuid.uuid4().hex)
    created: int = field(default_factory=lambda: int(time.time()))


def _check_unsupported(body: dict) -> list[str]:
    """Refuse what would change the answer and cannot be honoured; return the fields this
    server does not know, which it ignores, as vLLM does (clients such as LangChain and
    the OpenAI SDK send ``store``, ``metadata``, ``service_tier`` and more by default)."""
    if body.get("n", 1) != 1:
        raise bad_request("n must be 1: this server returns one choice per request", "n")
    if body.get("best_of", 1) not in (1, None):
        raise bad_request("best_of is not supported", "best_of")
    if body.get("logit_bias"):
        raise bad_request("logit_bias is not supported", "logit_bias")
    if body.get("suffix"):
        raise bad_request("suffix is not supported", "suffix")
    if body.get("tools") or body.get("tool_choice") not in (None, "none"):
        raise bad_request("tools are not supported", "tools")
    fmt = body.get("response_format")
    if fmt is not None and (not isinstance(fmt, dict) or fmt.get("type") != "text"):
        raise bad_request("response_format must be {'type': 'text'}", "response_format")
    return sorted(set(body) - set(SAMPLING_KEYS) - set(OTHER_KEYS))


def _sampling(body: dict, max_tokens_key: str, logprobs: int | None) -> dict:
    params = {k: body[k] for k in SAMPLING_KEYS if body.get(k) is not None}
    if logprobs is not None:
        params["logprobs"] = logprobs
    max_tokens = body.get(max_tokens_key, body.get("max_tokens"))
    params["max_tokens"] = DEFAULT_MAX_TOKENS if max_tokens is None else max_tokens
    try:
        SamplingParams.from_dict(params)  # the router checks again; a bad value is a 400 here
    except (ValueError, TypeError) as exc:
        raise bad_request(str(exc)) from None
    return params


def _stream_flags(body: dict) -> tuple[bool, bool]:
    stream = body.get("stream") or False
    if not isinstance(stream, bool):
        raise bad_request("stream must be a boolean", "stream")
    options = body.get("stream_options") or {}
    if options and not stream:
        raise bad_request("stream_options is only allowed when stream is true", "stream_options")
    return stream, bool(options.get("include_usage", False))


def check_model(body: dict, served: str) -> None:
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise bad_request("model is required", "model")
    if model != served:
        raise OpenAIError(404, f"The model `{model}` does not exist; this server serves `{served}`", "model",
                          "not_found_error")  # fmt: skip


def parse_completion(body: dict, served: str) -> RouterCall:
    check_model(body, served)
    ignored = _check_unsupported(body)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if not isinstance(prompt, str):
        raise bad_request("prompt must be a string (one prompt per request)", "prompt")
    if not prompt:
        raise bad_request("prompt must not be empty", "prompt")
    stream, include_usage = _stream_flags(body)
    echo = body.get("echo") or False
    logprobs = body.get("logprobs")
    if logprobs is not None and (isinstance(logprobs, bool) or not isinstance(logprobs, int)):
        raise bad_request("logprobs must be an integer (alternatives per token)", "logprobs")
    params = _sampling(body, "max_tokens", logprobs)
    return RouterCall(prompt, params, stream, include_usage, echo=bool(echo), logprobs=logprobs,
                      ignored=ignored)  # fmt: skip


def message_text(message: dict, index: int) -> tuple[str, str]:
    """(role, text) of a chat message; content may be a string or a list of text parts."""
    if not isinstance(message, dict):
        raise bad_request(f"messages[{index}] must be an object", "messages")
    role, content = message.get("role"), message.get("content")
    if role not in ("system", "developer", "user", "assistant"):
        raise bad_request(f"messages[{index}].role must be system, developer, user or assistant", "messages")
    if isinstance(content, list):
        parts = []
        for part in content:
            text = part.get("text") if isinstance(part, dict) and part.get("type") == "text" else None
            if not isinstance(text, str):
                raise bad_request(f"messages[{index}].content: only text parts are supported", "messages")
            parts.append(text)
        content = "".join(parts)
    if not isinstance(content, str):
        raise bad_request(f"messages[{index}].content must be a string or a list of text parts", "messages")
    return role, content


def parse_chat(body: dict, served: str, render: Callable[[list[dict]], str]) -> RouterCall:
    """``render`` applies the model's chat template (with the assistant's turn opened)."""
    check_model(body, served)
    ignored = _check_unsupported(body)
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise bad_request("messages must be a non-empty list", "messages")
    turns = [dict(zip(("role", "content"), message_text(m, i))) for i, m in enumerate(messages)]
    stream, include_usage = _stream_flags(body)
    wanted, top = body.get("logprobs") or False, body.get("top_logprobs")
    if not isinstance(wanted, bool):
        raise bad_request("logprobs must be a boolean", "logprobs")
    if top is not None and (not wanted or isinstance(top, bool) or not isinstance(top, int)):
        raise bad_request("top_logprobs must be an integer, and needs logprobs: true", "top_logprobs")
    logprobs = (top or 0) if wanted else None
    params = _sampling(body, "max_completion_tokens", logprobs)
    return RouterCall(render(turns), params, stream, include_usage, chat=True, logprobs=logprobs,
                      ignored=ignored)  # fmt: skip


# ---- answers -------------------------------------------------------------------------------


@dataclass
class Usage:
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0

    def body(self) -> dict:
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.prompt_tokens + self.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": self.cached_tokens},
        }


def _envelope(call: RouterCall, served: str, chunk: bool) -> dict:
    if call.chat:
        kind, prefix = ("chat.completion.chunk" if chunk else "chat.completion"), "chatcmpl-"
    else:
        kind, prefix = "text_completion", "cmpl-"
    return {"id": prefix + call.id, "object": kind, "created": call.created, "model": served}


def logprobs_body(call: RouterCall, steps: list[dict], offset: int = 0) -> dict | None:
    """OpenAI's logprobs of the sampled tokens from the router's steps (per token, keyed by
    token id, the sampled token first: ``{"logprob", "rank", "decoded_token"}``); chat's
    ``content`` list, or the completions' parallel lists with text offsets from ``offset``."""
    if call.logprobs is None:
        return None
    sampled = [next(iter(step.values())) for step in steps]
    tops = [sorted(step.values(), key=lambda e: e["rank"])[: call.logprobs] for step in steps]
    if call.chat:
        def entry(e):
            token = e["decoded_token"]
            return {"token": token, "logprob": e["logprob"], "bytes": list(token.encode())}

        return {"content": [{**entry(s), "top_logprobs": [entry(e) for e in top]}
                            for s, top in zip(sampled, tops)]}  # fmt: skip
    offsets = []
    for s in sampled:
        offsets.append(offset)
        offset += len(s["decoded_token"])
    return {
        "tokens": [s["decoded_token"] for s in sampled],
        "token_logprobs": [s["logprob"] for s in sampled],
        "top_logprobs": [{e["decoded_token"]: e["logprob"] for e in top} for top in tops],
        "text_offset": offsets,
    }


def completion_body(
    call: RouterCall, served: str, text: str, finish: str | None, usage: Usage, steps: list[dict] = ()
) -> dict:
    """The whole answer of a request that did not stream."""
    echoed = call.prompt if call.echo and not call.chat else ""
    logprobs = logprobs_body(call, list(steps), len(echoed))
    if call.chat:
        choice = {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": logprobs,
                  "finish_reason": finish}  # fmt: skip
    else:
        choice = {"index": 0, "text": echoed + text, "logprobs": logprobs, "finish_reason": finish}
    return {**_envelope(call, served, False), "choices": [choice], "usage": usage.body()}


def chunk_body(
    call: RouterCall, served: str, text: str | None, finish: str | None, first=False, logprobs=None
) -> dict:
    """One streamed chunk: new text (and its tokens' logprobs), or the finish reason on the
    last one."""
    if call.chat:
        delta = {"role": "assistant", "content": ""} if first else ({"content": text} if text else {})
        choice = {"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
    else:
        choice = {"index": 0, "text": text or "", "logprobs": logprobs, "finish_reason": finish}
    body = {**_envelope(call, served, True), "choices": [choice]}
    if call.include_usage:
        body["usage"] = None
    return body


def usage_chunk(call: RouterCall, served: str, usage: Usage) -> dict:
    """The extra last chunk ``stream_options.include_usage`` asks for: no choices, the usage."""
    return {**_envelope(call, served, True), "choices": [], "usage": usage.body()}


def sse(body: dict | str) -> bytes:
    return f"data: {body if isinstance(body, str) else json.dumps(body)}\n\n".encode()
