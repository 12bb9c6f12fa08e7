"""Tool calls on the OpenAI API: the tools checked, rendered into the prompt, the answer
constrained where the client demands a call, and parsed back into ``tool_calls``.

- ``tool_choice: "none"``: tools are rendered, the answer is text.
- ``"auto"`` (the default with tools): the model decides. A call is written in the Hermes
  format (``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, which Qwen,
  Hermes and SmolLM3 templates use and vLLM's ``hermes`` parser reads) and parsed back.
- ``"required"``: the answer is constrained to a JSON list of calls (vLLM's form:
  ``[{"name": ..., "parameters": {...}}]``) of the given tools; one call only with
  ``parallel_tool_calls: false``.
- a named function: the answer is constrained to that function's arguments.

A model whose chat template does not render tools (SmolLM2's does not) gets them in a
system message, with the Hermes call format, so that ``auto`` can work at all.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass

TOOL_CALL = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)
OPEN_TAG = "<tool_call>"
MAX_TOOLS = 128  # as OpenAI's API


@dataclass(frozen=True)
class Tools:
    """A request's tools and how it lets the model use them."""

    functions: tuple[dict, ...]  # each {"name", "description"?, "parameters"?}
    choice: str  # "none", "auto", "required" or "named"
    named: str | None = None
    parallel: bool = True  # parallel_tool_calls: more than one call per answer

    @property
    def schemas(self) -> list[dict]:
        return [{"type": "function", "function": f} for f in self.functions]

    def guide(self) -> dict | None:
        """The structured output that forces the demanded call, as a sampling parameter."""
        params = {f["name"]: f.get("parameters") or {"type": "object"} for f in self.functions}
        if self.choice == "named":
            return {"json": params[self.named]}
        if self.choice == "required":
            call = [{"type": "object", "properties": {"name": {"const": name}, "parameters": schema},
                     "required": ["name", "parameters"], "additionalProperties": False}
                    for name, schema in params.items()]  # fmt: skip
            calls = {"type": "array", "minItems": 1, "items": {"anyOf": call}}
            return {"json": calls if self.parallel else {**calls, "maxItems": 1}}
        return None

    def calls(self, text: str) -> tuple[str | None, list[dict]]:
        """The answer's text split into (content, OpenAI ``tool_calls``)."""
        if self.choice == "named":
            return None, [_call(self.named, text)]
        if self.choice == "required":
            calls = _json(text)
            if not isinstance(calls, list):  # cut short (max_tokens): the text is all there is
                return text, []
            return None, [_call(c["name"], json.dumps(c["parameters"])) for c in calls]
        if self.choice == "none":
            return text, []
        found = []
        for match in TOOL_CALL.finditer(text):
            call = _json(match.group(1))
            if not isinstance(call, dict) or call.get("name") not in {f["name"] for f in self.functions}:
                return text, []  # not a well-formed call of a known tool: the text is the answer
            found.append(_call(call["name"], json.dumps(call.get("arguments", call.get("parameters", {})))))
        if not found:
            return text, []
        content = TOOL_CALL.sub("", text).strip()
        return content or None, found


def parse_tools(body: dict, bad_request) -> Tools | None:
    """The request's ``tools`` and ``tool_choice``, checked (a wrong shape is a 400 naming
    the field); None without tools."""
    tools, choice = body.get("tools"), body.get("tool_choice")
    if not tools:
        if choice not in (None, "none"):
            raise bad_request("tool_choice needs tools", "tool_choice")
        return None
    if not isinstance(tools, list):
        raise bad_request("tools must be a list", "tools")
    if len(tools) > MAX_TOOLS:
        raise bad_request(f"tools must hold at most {MAX_TOOLS} tools, got {len(tools)}", "tools")
    functions = []
    for i, tool in enumerate(tools):
        function = tool.get("function") if isinstance(tool, dict) and tool.get("type") == "function" else None
        name = function.get("name") if isinstance(function, dict) else None
        if not isinstance(name, str) or not name:
            raise bad_request(f"tools[{i}] must be {{'type': 'function', 'function': {{'name': ...}}}}",
                              "tools")  # fmt: skip
        parameters = function.get("parameters")
        if parameters is not None and not isinstance(parameters, dict):
            raise bad_request(f"tools[{i}].function.parameters must be a JSON schema (an object)", "tools")
        functions.append({k: function[k] for k in ("name", "description", "parameters") if k in function})
    names = [f["name"] for f in functions]
    parallel = body.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        raise bad_request("parallel_tool_calls must be a boolean", "parallel_tool_calls")
    if choice is None or choice in ("none", "auto", "required"):
        return Tools(tuple(functions), choice or "auto", parallel=parallel is not False)
    named = choice.get("function", {}).get("name") if isinstance(choice, dict) else None
    if not isinstance(choice, dict) or choice.get("type") != "function" or not isinstance(named, str):
        raise bad_request("tool_choice must be none, auto, required or {'type': 'function', 'function': "
                          "{'name': ...}}", "tool_choice")  # fmt: skip
    if named not in names:
        raise bad_request(f"tool_choice names {named!r}, which is not among the tools ({', '.join(names)})",
                          "tool_choice")  # fmt: skip
    return Tools(tuple(functions), "named", named, parallel is not False)


def chat_turns(messages: list[dict], tools: Tools | None, template_renders_tools: bool) -> list[dict]:
    """The turns for the chat template. A template that renders tools gets them as they
    are (tool-call arguments as objects, as Hugging Face templates expect); for one that
    does not, tools go into a system message and calls and results into the text."""
    if template_renders_tools:
        return [_with_parsed_arguments(m) for m in messages]
    turns = []
    for m in messages:
        if m["role"] == "tool":
            turns.append({"role": "user", "content": f"<tool_response>\n{m['content']}\n</tool_response>"})
        elif m.get("tool_calls"):
            calls = [f"{OPEN_TAG}\n{json.dumps(_hermes(c))}\n</tool_call>" for c in m["tool_calls"]]
            turns.append({"role": "assistant", "content": "\n".join([m["content"] or "", *calls]).strip()})
        else:
            turns.append({"role": m["role"], "content": m["content"]})
    if tools is None:
        return turns
    listing = "\n".join(json.dumps(s) for s in tools.schemas)
    system = ("You may call one or more functions to assist with the user query. The functions are:\n"
              f"<tools>\n{listing}\n</tools>\nFor each call, answer with a JSON object of the function's "
              'name and arguments in tags: <tool_call>\n{"name": <name>, "arguments": <arguments>}\n'
              "</tool_call>")  # fmt: skip
    if turns and turns[0]["role"] in ("system", "developer"):
        return [{"role": "system", "content": f"{turns[0]['content']}\n\n{system}"}, *turns[1:]]
    return [{"role": "system", "content": system}, *turns]


class ToolStream:
    """Streams an ``auto`` answer's text until a call may begin, then holds the rest back
    to be parsed at the end (so no half call reaches the client as content)."""

    def __init__(self, tools: Tools) -> None:
        self.tools, self.held, self.sent = tools, "", ""

    def feed(self, text: str) -> str:
        """The part of the text so far that is surely content."""
        self.held += text
        if self.tools.choice != "auto":
            return ""
        at = self.held.find(OPEN_TAG)
        if at < 0:  # keep back a tail that could be the tag's start
            at = next((i for i in range(max(0, len(self.held) - len(OPEN_TAG)), len(self.held))
                       if OPEN_TAG.startswith(self.held[i:])), len(self.held))  # fmt: skip
        out, self.held = self.held[:at], self.held[at:]
        self.sent += out
        return out

    def finish(self) -> tuple[str | None, list[dict]]:
        """What the held text is: more content, or the calls."""
        _, calls = self.tools.calls(self.sent + self.held)
        if not calls:
            return self.held, []
        return None, calls


def _call(name: str, arguments: str) -> dict:
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": name, "arguments": arguments}}  # fmt: skip


def _json(text: str):
    try:
        return json.loads(text)
    except (json.JSONDecodeError, RecursionError):
        return None


def _hermes(call: dict) -> dict:
    function = call.get("function", {})
    arguments = function.get("arguments", "{}")
    parsed = _json(arguments) if isinstance(arguments, str) else arguments
    return {"name": function.get("name"), "arguments": parsed}


def _with_parsed_arguments(message: dict) -> dict:
    if not message.get("tool_calls"):
        return message
    calls = [{**c, "function": {**c.get("function", {}), "arguments": _hermes(c)["arguments"]}}
             for c in message["tool_calls"]]  # fmt: skip
    return {**message, "tool_calls": calls}
