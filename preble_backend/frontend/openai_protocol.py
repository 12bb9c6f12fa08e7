"""OpenAI's ``/v1/completions`` and ``/v1/chat/completions`` requests mapped onto the
router's contract (Triton's vLLM-backend inputs), and the router's answers and errors in
OpenAI's shapes. Free of HTTP and gRPC: the server (``openai_server``) moves the bytes.

Sampling follows vLLM's OpenAI server: OpenAI's keys (``max_tokens``, or
``max_completion_tokens`` for chat; ``temperature``, ``top_p``, ``stop``, ``seed``,
``presence_penalty``, ``frequency_penalty``) and vLLM's extras (``top_k``,
``min_tokens``, ``repetition_penalty``, ``ignore_eos``, ``stop_token_ids``); logprobs of
the sampled tokens as OpenAI returns them (completions: ``logprobs: k``; chat:
``logprobs: true`` and ``top_logprobs: k``); ``n`` choices; structured output
(``response_format`` ``json_object`` or ``json_schema``, and vLLM's ``structured_outputs``
and ``guided_*`` keys) and tool calls (``tool_calls.py``). Fields this server does not
know are ignored and logged, as vLLM does; what would change the answer and cannot be
honoured (``best_of``, ``logit_bias``, ``suffix``) is refused, naming the field."""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field

from preble_backend.common.sampling_params import SamplingParams
from preble_backend.common.structured_outputs import LEGACY_KEYS
from preble_backend.frontend.tool_calls import Tools, parse_tools

SAMPLING_KEYS = (
    "temperature", "top_p", "stop", "seed", "presence_penalty", "frequency_penalty",
    "top_k", "min_tokens", "repetition_penalty", "ignore_eos", "stop_token_ids",
)  # fmt: skip
OTHER_KEYS = (  # read by the parsers or checked by _check_unsupported (``user``: ignored)
    "model", "stream", "stream_options", "user", "messages", "prompt", "echo", "max_tokens",
    "max_completion_tokens", "n", "best_of", "logit_bias", "suffix", "response_format",
    "tools", "tool_choice", "logprobs", "top_logprobs", "parallel_tool_calls",
)  # fmt: skip
GUIDE_KEYS = ("structured_outputs", *LEGACY_KEYS)  # vLLM's extras: passed on as sampling parameters
DEFAULT_MAX_TOKENS = 16  # OpenAI's and vLLM's default for completions
MAX_N = 32  # choices per request
MAX_CHOICE_TOKENS = 1 << 17  # n x max_tokens: what one request may make the engines generate


ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
               429: "rate_limit_exceeded", 503: "service_unavailable"}  # fmt: skip


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
    n: int = 1  # choices, each its own router request after the first's prefill
    tools: Tools | None = None
    ignored: list[str] = field(default_factory=list)  # fields this server does not know (logged)
    tenant: dict[str, str] = field(default_factory=dict)  # the tenant's request parameters (tenant_gate.py)
    id: str = field(default_factory=lambda: uuid.uuid4().hex)
    created: int = field(default_factory=lambda: int(time.time()))


def _check_unsupported(body: dict) -> list[str]:
    """Refuse what would change the answer and cannot be honoured; return the fields this
    server does not know, which it ignores, as vLLM does (clients such as LangChain and
    the OpenAI SDK send ``store``, ``metadata``, ``service_tier`` and more by default)."""
    n = body.get("n")
    if n is not None and (isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= MAX_N):
        raise bad_request(f"n must be an integer from 1 to {MAX_N}", "n")
    if body.get("best_of", 1) not in (1, None):
        raise bad_request("best_of is not supported", "best_of")
    if body.get("logit_bias"):
        raise bad_request("logit_bias is not supported", "logit_bias")
    if body.get("suffix"):
        raise bad_request("suffix is not supported", "suffix")
    return sorted(set(body) - set(SAMPLING_KEYS) - set(OTHER_KEYS) - set(GUIDE_KEYS))


def _guide(body: dict, tools: Tools | None = None) -> dict:
    """The sampling parameter that constrains the answer, from ``response_format``,
    vLLM's ``structured_outputs``/``guided_*`` keys, or the tool call a request demands."""
    given = {k: body[k] for k in GUIDE_KEYS if body.get(k) is not None}
    fmt = body.get("response_format")
    if fmt is not None:
        kind = fmt.get("type") if isinstance(fmt, dict) else None
        if kind not in ("text", "json_object", "json_schema"):
            raise bad_request("response_format.type must be text, json_object or json_schema",
                              "response_format")  # fmt: skip
        if kind == "json_object":
            given["response_format"] = {"json_object": True}
        elif kind == "json_schema":
            spec = fmt.get("json_schema")
            schema = spec.get("schema") if isinstance(spec, dict) else None
            if not isinstance(schema, dict):
                raise bad_request("response_format.json_schema.schema must be a JSON schema (an object)",
                                  "response_format")  # fmt: skip
            given["response_format"] = {"json": schema}
    forced = tools.guide() if tools is not None else None
    if forced is not None:
        given["tool_choice"] = forced
    if len(given) > 1:
        raise bad_request(f"{' and '.join(given)} both constrain the answer: send one", next(iter(given)))
    if not given:
        return {}
    ((key, value),) = given.items()
    return {key if key in GUIDE_KEYS else "structured_outputs": value}


def _sampling(body: dict, max_tokens_key: str, logprobs: int | None, guide: dict) -> dict:
    params = {k: body[k] for k in SAMPLING_KEYS if body.get(k) is not None}
    params.update(guide)
    if logprobs is not None:
        params["logprobs"] = logprobs
    max_tokens = body.get(max_tokens_key, body.get("max_tokens"))
    params["max_tokens"] = DEFAULT_MAX_TOKENS if max_tokens is None else max_tokens
    try:
        checked = SamplingParams.from_dict(params)  # the router checks again; a bad value is a 400 here
    except (ValueError, TypeError) as exc:
        raise bad_request(str(exc)) from None
    n = body.get("n") or 1
    if n > 1 and n * checked.max_tokens > MAX_CHOICE_TOKENS:  # one choice: the context bounds it
        raise bad_request(f"n x max_tokens is {n} x {checked.max_tokens}: more than the limit of "
                          f"{MAX_CHOICE_TOKENS} tokens per request", "n")  # fmt: skip
    return params


def _stream_flags(body: dict) -> tuple[bool, bool]:
    stream = body.get("stream") or False
    if not isinstance(stream, bool):
        raise bad_request("stream must be a boolean", "stream")
    options = body.get("stream_options") or {}
    if options and not stream:
        raise bad_request("stream_options is only allowed when stream is true", "stream_options")
    return stream, bool(options.get("include_usage", False))


class Served(str):
    """The served model's name, as answers carry it, and the other names requests may use
    for it (``preble``, the router model's name, which Triton tools send)."""

    def __new__(cls, name: str, aliases: tuple[str, ...] = ()) -> Served:
        served = super().__new__(cls, name)
        served.aliases = tuple(a for a in aliases if a != name)
        return served

    @property
    def names(self) -> tuple[str, ...]:
        return (str(self), *self.aliases)


def check_model(body: dict, served: str) -> None:
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise bad_request("model is required", "model")
    names = served.names if isinstance(served, Served) else (served,)
    if model not in names:
        listed = " or ".join(f"`{n}`" for n in names)
        raise OpenAIError(404, f"The model `{model}` does not exist; this server serves {listed}", "model",
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
    if body.get("tools") or body.get("tool_choice") is not None:
        raise bad_request("tools are for /v1/chat/completions", "tools")
    params = _sampling(body, "max_tokens", logprobs, _guide(body))
    return RouterCall(prompt, params, stream, include_usage, echo=bool(echo), logprobs=logprobs,
                      n=body.get("n") or 1, ignored=ignored)  # fmt: skip


def chat_message(message: dict, index: int) -> dict:
    """A chat message checked: ``role`` and text ``content`` (a string or a list of text
    parts), an assistant's ``tool_calls``, a tool result's ``tool_call_id``."""
    if not isinstance(message, dict):
        raise bad_request(f"messages[{index}] must be an object", "messages")
    role, content = message.get("role"), message.get("content")
    if role not in ("system", "developer", "user", "assistant", "tool"):
        raise bad_request(f"messages[{index}].role must be system, developer, user, assistant or tool",
                          "messages")  # fmt: skip
    if isinstance(content, list):
        parts = []
        for part in content:
            text = part.get("text") if isinstance(part, dict) and part.get("type") == "text" else None
            if not isinstance(text, str):
                raise bad_request(f"messages[{index}].content: only text parts are supported", "messages")
            parts.append(text)
        content = "".join(parts)
    calls = message.get("tool_calls") if role == "assistant" else None
    if calls is not None and (not isinstance(calls, list) or not all(isinstance(c, dict) for c in calls)):
        raise bad_request(f"messages[{index}].tool_calls must be a list of objects", "messages")
    if not isinstance(content, str) and not (calls and content is None):
        raise bad_request(f"messages[{index}].content must be a string or a list of text parts", "messages")
    turn = {"role": role, "content": content}
    if calls:
        turn["tool_calls"] = calls
    if role == "tool" and isinstance(message.get("tool_call_id"), str):
        turn["tool_call_id"] = message["tool_call_id"]
    return turn


def parse_chat(body: dict, served: str, render: Callable[..., str]) -> RouterCall:
    """``render(turns, tools)`` applies the model's chat template, the assistant's turn
    opened (``tools``: the tools' JSON schemas, for a template that renders them)."""
    check_model(body, served)
    ignored = _check_unsupported(body)
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise bad_request("messages must be a non-empty list", "messages")
    turns = [chat_message(m, i) for i, m in enumerate(messages)]
    tools = parse_tools(body, bad_request)
    stream, include_usage = _stream_flags(body)
    wanted, top = body.get("logprobs") or False, body.get("top_logprobs")
    if not isinstance(wanted, bool):
        raise bad_request("logprobs must be a boolean", "logprobs")
    if top is not None and (not wanted or isinstance(top, bool) or not isinstance(top, int)):
        raise bad_request("top_logprobs must be an integer, and needs logprobs: true", "top_logprobs")
    logprobs = (top or 0) if wanted else None
    params = _sampling(body, "max_completion_tokens", logprobs, _guide(body, tools))
    prompt = render(turns, tools)
    return RouterCall(prompt, params, stream, include_usage, chat=True, logprobs=logprobs,
                      n=body.get("n") or 1, tools=tools, ignored=ignored)  # fmt: skip


# ---- answers -------------------------------------------------------------------------------


@dataclass
class Piece:
    """What one router response adds: new text, and on the last one the finish reason."""

    text: str
    output_tokens: int
    final: bool
    finish_reason: str | None = None
    prompt_tokens: int = 0
    cached_tokens: int = 0
    logprobs: list[dict] = field(default_factory=list)  # the router's steps, one per new token
    engine: str | None = None  # the engine serving it (on the first and the last piece)


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

    def add(self, piece: Piece, choice: int = 0) -> str | None:
        """Count a piece of choice ``choice`` (the prompt once, as OpenAI counts it for
        ``n``); return its finish reason."""
        self.completion_tokens += piece.output_tokens
        if piece.final and choice == 0:
            self.prompt_tokens, self.cached_tokens = piece.prompt_tokens, piece.cached_tokens
        return piece.finish_reason


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


@dataclass
class Choice:
    """One choice's whole answer: its text, finish reason and logprob steps."""

    text: str = ""
    finish: str | None = None
    steps: list[dict] = field(default_factory=list)


def completion_body(call: RouterCall, served: str, choices: list[Choice], usage: Usage) -> dict:
    """The whole answer of a request that did not stream."""
    echoed = call.prompt if call.echo and not call.chat else ""
    bodies = []
    for index, c in enumerate(choices):
        logprobs = logprobs_body(call, c.steps, len(echoed))
        if not call.chat:
            bodies.append({"index": index, "text": echoed + c.text, "logprobs": logprobs,
                           "finish_reason": c.finish})  # fmt: skip
            continue
        message, finish = {"role": "assistant", "content": c.text}, c.finish
        if call.tools is not None:
            content, calls = call.tools.calls(c.text)
            message["content"] = content
            if calls:
                message["tool_calls"] = calls
                finish = "tool_calls" if finish == "stop" else finish
        bodies.append({"index": index, "message": message, "logprobs": logprobs, "finish_reason": finish})
    return {**_envelope(call, served, False), "choices": bodies, "usage": usage.body()}


def chunk_body(
    call: RouterCall, served: str, text: str | None, finish: str | None, first=False, logprobs=None,
    index: int = 0, tool_calls: list[dict] | None = None,
) -> dict:  # fmt: skip
    """One streamed chunk of choice ``index``: new text (and its tokens' logprobs), the
    tool calls, or the finish reason on the last one."""
    if call.chat:
        delta = {"role": "assistant", "content": ""} if first else ({"content": text} if text else {})
        if tool_calls:
            delta = {"tool_calls": [{"index": i, **c} for i, c in enumerate(tool_calls)]}
        choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
    else:
        choice = {"index": index, "text": text or "", "logprobs": logprobs, "finish_reason": finish}
    body = {**_envelope(call, served, True), "choices": [choice]}
    if call.include_usage:
        body["usage"] = None
    return body


def usage_chunk(call: RouterCall, served: str, usage: Usage) -> dict:
    """The extra last chunk ``stream_options.include_usage`` asks for: no choices, the usage."""
    return {**_envelope(call, served, True), "choices": [], "usage": usage.body()}


def sse(body: dict | str) -> bytes:
    return f"data: {body if isinstance(body, str) else json.dumps(body)}\n\n".encode()
