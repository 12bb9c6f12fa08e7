"""OpenAI's Responses API (``POST /v1/responses``) on the chat machinery: a request is
rewritten as a chat completion (``input`` and ``instructions`` as turns, ``text.format``
as ``response_format``, function tools as chat tools), and the answer is shaped as a
``response`` object, or streamed as its typed events.

Stateless, as vLLM serves it without a store: ``previous_response_id`` is refused (send
the conversation in ``input``, function calls and their outputs included), and ``store``
is ignored. Only function tools exist here; built-in tools (web search, files, ...) are
refused by name.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator

from preble_backend.frontend.openai_protocol import Choice, OpenAIError, RouterCall, Usage, bad_request
from preble_backend.frontend.tool_calls import ToolStream

PASSED = (
    "model",
    "temperature",
    "top_p",
    "stream",
    "parallel_tool_calls",
    "user",
    "top_k",
    "min_tokens",
    "repetition_penalty",
    "seed",
    "stop",
    "ignore_eos",
)  # vLLM's extras too
KNOWN = (
    *PASSED,
    "input",
    "instructions",
    "max_output_tokens",
    "text",
    "tools",
    "tool_choice",
    "previous_response_id",
)


def chat_body(body: dict) -> dict:
    """The Responses request as a chat completions request."""
    if body.get("previous_response_id"):
        raise bad_request(
            "previous_response_id is not supported: this server stores no responses; send the "
            "conversation in input",
            "previous_response_id",
        )
    chat = {k: body[k] for k in PASSED if k in body}
    chat["messages"] = (
        [{"role": "system", "content": body["instructions"]}] if body.get("instructions") else []
    ) + _turns(body.get("input"))
    if body.get("max_output_tokens") is not None:
        chat["max_completion_tokens"] = body["max_output_tokens"]
    fmt = (body.get("text") or {}).get("format") if isinstance(body.get("text"), dict) else None
    if isinstance(fmt, dict) and fmt.get("type") == "json_schema":
        chat["response_format"] = {
            "type": "json_schema",
            "json_schema": {"name": fmt.get("name", "answer"), "schema": fmt.get("schema")},
        }
    elif fmt is not None:
        chat["response_format"] = fmt
    if body.get("tools"):
        chat["tools"] = [_tool(t, i) for i, t in enumerate(body["tools"])]
    choice = body.get("tool_choice")
    if isinstance(choice, dict) and choice.get("type") == "function":
        choice = {"type": "function", "function": {"name": choice.get("name")}}
    if choice is not None:
        chat["tool_choice"] = choice
    return chat


def _turns(given) -> list[dict]:
    if isinstance(given, str):
        return [{"role": "user", "content": given}]
    if not isinstance(given, list) or not given:
        raise bad_request("input must be a string or a non-empty list of items", "input")
    turns = []
    for i, item in enumerate(given):
        kind = item.get("type", "message") if isinstance(item, dict) else None
        if kind == "message":
            content = item.get("content")
            if isinstance(content, list):
                parts = [p.get("text") for p in content if isinstance(p, dict)]
                if not all(isinstance(p, str) for p in parts) or len(parts) != len(content):
                    raise bad_request(f"input[{i}].content: only text parts are supported", "input")
                content = "".join(parts)
            turns.append({"role": item.get("role"), "content": content})
        elif kind == "function_call":
            call = {
                "id": item.get("call_id"),
                "type": "function",
                "function": {"name": item.get("name"), "arguments": item.get("arguments", "{}")},
            }
            turns.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            turns.append(
                {"role": "tool", "tool_call_id": item.get("call_id"), "content": str(item.get("output"))}
            )
        else:
            raise bad_request(
                f"input[{i}]: item type {kind!r} is not supported (message, function_call, "
                "function_call_output)",
                "input",
            )
    return turns


def _tool(tool, index: int) -> dict:
    if not isinstance(tool, dict) or tool.get("type") != "function":
        kind = tool.get("type") if isinstance(tool, dict) else tool
        raise bad_request(f"tools[{index}]: only function tools are supported, not {kind!r}", "tools")
    return {
        "type": "function",
        "function": {k: tool[k] for k in ("name", "description", "parameters") if k in tool},
    }


def response_object(
    call: RouterCall,
    served: str,
    body: dict,
    choice: Choice,
    usage: Usage,
    status: str = "completed",
) -> dict:
    """The ``response`` object: a message item with the text, a function_call item per call."""
    content, calls = call.tools.calls(choice.text) if call.tools is not None else (choice.text, [])
    output = [_function_call(c) for c in calls]
    if content:
        output.insert(0, _message(f"msg_{call.id}", content))
    incomplete = choice.finish == "length"
    return {
        "id": f"resp_{call.id}",
        "object": "response",
        "created_at": call.created,
        "model": served,
        "status": "incomplete" if incomplete and status == "completed" else status,
        "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
        "error": None,
        "instructions": body.get("instructions"),
        "max_output_tokens": body.get("max_output_tokens"),
        "temperature": body.get("temperature"),
        "top_p": body.get("top_p"),
        "tools": body.get("tools") or [],
        "tool_choice": body.get("tool_choice", "auto"),
        "parallel_tool_calls": body.get("parallel_tool_calls", True),
        "text": body.get("text") or {"format": {"type": "text"}},
        "output": output,
        "usage": {
            "input_tokens": usage.prompt_tokens,
            "input_tokens_details": {"cached_tokens": usage.cached_tokens},
            "output_tokens": usage.completion_tokens,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": usage.prompt_tokens + usage.completion_tokens,
        },
    }


def _message(mid: str, text: str, status: str = "completed") -> dict:
    return {
        "type": "message",
        "id": mid,
        "status": status,
        "role": "assistant",
        "content": [{"type": "output_text", "text": text, "annotations": []}],
    }


def _function_call(call: dict) -> dict:
    return {
        "type": "function_call",
        "id": f"fc_{uuid.uuid4().hex[:24]}",
        "call_id": call["id"],
        "name": call["function"]["name"],
        "arguments": call["function"]["arguments"],
        "status": "completed",
    }


async def response_events(
    call: RouterCall, served: str, body: dict, pieces: AsyncIterator
) -> AsyncIterator[bytes]:
    """The answer as the Responses API streams it: created, the message's text deltas,
    function calls once whole, completed (or an ``error`` event)."""
    seq = iter(range(1 << 62))
    mid, choice, usage = f"msg_{call.id}", Choice(), Usage()

    def event(kind: str, **data) -> bytes:
        payload = json.dumps({"type": kind, "sequence_number": next(seq), **data})
        return f"event: {kind}\ndata: {payload}\n\n".encode()

    started = response_object(call, served, body, choice, usage, status="in_progress")
    yield event("response.created", response=started)
    yield event("response.in_progress", response=started)
    tools, text_open, sent = ToolStream(call.tools) if call.tools else None, False, ""
    try:
        async for piece in pieces:
            choice.text += piece.text
            choice.finish = usage.add(piece) or choice.finish
            delta = tools.feed(piece.text) if tools else piece.text
            if delta and not text_open:
                text_open = True
                yield event(
                    "response.output_item.added", output_index=0, item=_message(mid, "", "in_progress")
                )
                part = {"type": "output_text", "text": "", "annotations": []}
                yield event(
                    "response.content_part.added", item_id=mid, output_index=0, content_index=0, part=part
                )
            if delta:
                sent += delta
                yield event(
                    "response.output_text.delta", item_id=mid, output_index=0, content_index=0, delta=delta
                )
    except OpenAIError as exc:
        yield event("error", code=str(exc.status), message=exc.message, param=exc.param)
        return
    final = response_object(call, served, body, choice, usage)
    if text_open:
        part = {"type": "output_text", "text": sent, "annotations": []}
        yield event("response.output_text.done", item_id=mid, output_index=0, content_index=0, text=sent)
        yield event("response.content_part.done", item_id=mid, output_index=0, content_index=0, part=part)
        yield event("response.output_item.done", output_index=0, item=_message(mid, sent))
    for index, item in enumerate(
        (i for i in final["output"] if i["type"] == "function_call"), start=int(text_open)
    ):
        yield event(
            "response.output_item.added",
            output_index=index,
            item={**item, "status": "in_progress", "arguments": ""},
        )
        yield event(
            "response.function_call_arguments.delta",
            item_id=item["id"],
            output_index=index,
            delta=item["arguments"],
        )
        yield event(
            "response.function_call_arguments.done",
            item_id=item["id"],
            output_index=index,
            arguments=item["arguments"],
        )
        yield event("response.output_item.done", output_index=index, item=item)
    if text_open:  # the streamed text is the message's, whatever the parse made of the whole
        final["output"] = [_message(mid, sent), *(i for i in final["output"] if i["type"] == "function_call")]
    yield event(
        "response.completed" if final["status"] == "completed" else "response.incomplete", response=final
    )
