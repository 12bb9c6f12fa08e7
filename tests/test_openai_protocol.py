"""OpenAI requests mapped onto the router's contract, and answers in OpenAI's shapes."""

from __future__ import annotations

import json

import pytest

from preble_backend.common.sampling_params import SamplingParams
from preble_backend.frontend.openai_protocol import (
    Choice,
    OpenAIError,
    Served,
    Usage,
    chunk_body,
    completion_body,
    logprobs_body,
    parse_chat,
    parse_completion,
    usage_chunk,
)


def render(messages, tools=None):
    return "".join(f"<{m['role']}>{m['content']}" for m in messages) + "<assistant>"


def test_completion_sampling_is_vllms():
    call = parse_completion({"model": "m", "prompt": ["hi"], "temperature": 0, "stop": "x", "top_k": 3}, "m")
    assert call.prompt == "hi" and not call.stream
    assert call.params == {"temperature": 0, "stop": "x", "top_k": 3, "max_tokens": 16}


def test_chat_renders_text_parts_and_prefers_max_completion_tokens():
    parts = [{"type": "text", "text": t} for t in "ab"]
    body = {"model": "m", "max_tokens": 5, "max_completion_tokens": 7, "stream": True,
            "stream_options": {"include_usage": True},
            "messages": [{"role": "system", "content": "S"}, {"role": "user", "content": parts}]}  # fmt: skip
    call = parse_chat(body, "m", render)
    assert call.prompt == "<system>S<user>ab<assistant>" and call.params["max_tokens"] == 7
    assert call.chat and call.stream and call.include_usage


@pytest.mark.parametrize(
    "body, status, words",
    [
        ({"prompt": "x"}, 400, "model is required"),
        ({"model": "other", "prompt": "x"}, 404, "`other` does not exist"),
        ({"model": "m", "prompt": ""}, 400, "must not be empty"),
        ({"model": "m", "prompt": ["a", "b"]}, 400, "one prompt per request"),
        ({"model": "m", "prompt": "x", "top_p": 2}, 400, "top_p"),
        ({"model": "m", "prompt": "x", "max_tokens": "many"}, 400, "max_tokens"),
        ({"model": "m", "prompt": "x", "n": 0}, 400, "n must be an integer from 1 to 32"),
        ({"model": "m", "prompt": "x", "best_of": 3}, 400, "best_of"),
        ({"model": "m", "prompt": "x", "response_format": {"type": "yaml"}}, 400, "response_format.type"),
        ({"model": "m", "prompt": "x", "response_format": {"type": "json_schema"}}, 400, "schema must be"),
        (
            {"model": "m", "prompt": "x", "response_format": {"type": "json_object"}, "guided_regex": "a"},
            400,
            "both constrain",
        ),
        ({"model": "m", "prompt": "x", "guided_choice": []}, 400, "guided_choice must be a non-empty list"),
        (
            {"model": "m", "prompt": "x", "tools": [{"type": "function", "function": {"name": "f"}}]},
            400,
            "tools are for /v1/chat/completions",
        ),
        ({"model": "m", "prompt": "x", "logprobs": True}, 400, "logprobs must be an integer"),
        ({"model": "m", "prompt": "x", "logprobs": 21}, 400, "logprobs must be in [0, 20]"),
        ({"model": "m", "prompt": "x", "stream_options": {"include_usage": True}}, 400, "only allowed when"),
    ],
)
def test_bad_completions_are_named(body, status, words):
    with pytest.raises(OpenAIError) as info:
        parse_completion(body, "m")
    assert info.value.status == status and words in info.value.message
    error = info.value.body()["error"]
    assert error["message"] == info.value.message and error["code"] == status and error["type"]


def test_unknown_fields_are_ignored_and_named_as_vllm_does():
    body = {"model": "m", "prompt": "x", "store": False, "metadata": {"a": "b"}, "service_tier": "auto"}
    call = parse_completion(body, "m")
    assert call.ignored == ["metadata", "service_tier", "store"] and call.prompt == "x"
    assert parse_completion({"model": "m", "prompt": "x"}, "m").ignored == []


def test_bad_chat_messages_are_named():
    image = [{"role": "user", "content": [{"type": "image_url"}]}]
    for messages, words in (([], "non-empty"), ([{"role": "robot", "content": "x"}], "role"),
                            (image, "only text parts")):  # fmt: skip
        with pytest.raises(OpenAIError, match=words):
            parse_chat({"model": "m", "messages": messages}, "m", render)


def test_answers_in_openais_shapes():
    usage = Usage(prompt_tokens=10, completion_tokens=4, cached_tokens=8)
    call = parse_completion({"model": "m", "prompt": "Q:", "echo": True}, "m")
    body = completion_body(call, "m", [Choice(" A", "stop")], usage)
    assert body["object"] == "text_completion" and body["id"].startswith("cmpl-")
    assert body["choices"] == [{"index": 0, "text": "Q: A", "logprobs": None, "finish_reason": "stop"}]
    assert body["usage"] == {"prompt_tokens": 10, "completion_tokens": 4, "total_tokens": 14,
                             "prompt_tokens_details": {"cached_tokens": 8}}  # fmt: skip
    chat = parse_chat({"model": "m", "messages": [{"role": "user", "content": "x"}], "stream": True,
                       "stream_options": {"include_usage": True}}, "m", render)  # fmt: skip
    first = chunk_body(chat, "m", None, None, first=True)
    assert first["object"] == "chat.completion.chunk"
    assert first["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert first["usage"] is None  # include_usage: every chunk has the key, the last one the value
    assert chunk_body(chat, "m", None, "length")["choices"][0] == {"index": 0, "delta": {}, "logprobs": None,
                                                                   "finish_reason": "length"}  # fmt: skip
    last = usage_chunk(chat, "m", usage)
    assert last["choices"] == [] and last["usage"]["total_tokens"] == 14


STEPS = [  # the router's logprobs: per token, keyed by id, the sampled token first
    {"5": {"logprob": -0.5, "rank": 2, "decoded_token": "ab"}, "7": {"logprob": -0.1, "rank": 1,
     "decoded_token": "b"}, "9": {"logprob": -3.0, "rank": 3, "decoded_token": "c"}},
    {"7": {"logprob": -0.2, "rank": 1, "decoded_token": "b"}, "9": {"logprob": -4.0, "rank": 2,
     "decoded_token": "c"}},
]  # fmt: skip


def test_logprobs_as_openai_returns_them():
    call = parse_completion({"model": "m", "prompt": "Q:", "logprobs": 2, "echo": True}, "m")
    assert call.params["logprobs"] == 2
    body = completion_body(call, "m", [Choice("abb", "length", STEPS)], Usage())["choices"][0]["logprobs"]
    assert body == {"tokens": ["ab", "b"], "token_logprobs": [-0.5, -0.2],
                    "top_logprobs": [{"b": -0.1, "ab": -0.5}, {"b": -0.2, "c": -4.0}],
                    "text_offset": [2, 4]}  # fmt: skip
    chat = parse_chat({"model": "m", "messages": [{"role": "user", "content": "x"}], "logprobs": True,
                       "top_logprobs": 1}, "m", render)  # fmt: skip
    [first, _] = logprobs_body(chat, STEPS)["content"]
    assert first == {"token": "ab", "logprob": -0.5, "bytes": [97, 98],
                     "top_logprobs": [{"token": "b", "logprob": -0.1, "bytes": [98]}]}  # fmt: skip
    assert logprobs_body(parse_completion({"model": "m", "prompt": "x"}, "m"), STEPS) is None
    with pytest.raises(OpenAIError, match="needs logprobs: true"):
        parse_chat({"model": "m", "messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, "m",
                   render)  # fmt: skip


def test_structured_output_keys_become_one_sampling_parameter():
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema, "strict": True}}
    call = parse_completion({"model": "m", "prompt": "x", "response_format": fmt}, "m")
    assert call.params["structured_outputs"] == {"json": schema}
    guide = SamplingParams.from_dict(call.params).guide
    assert (guide.kind, json.loads(guide.spec)) == ("json", schema)
    call = parse_completion({"model": "m", "prompt": "x", "response_format": {"type": "json_object"}}, "m")
    assert SamplingParams.from_dict(call.params).guide.kind == "json_object"
    call = parse_completion({"model": "m", "prompt": "x", "guided_choice": ["yes", "no"]}, "m")
    assert call.params["guided_choice"] == ["yes", "no"] and call.ignored == []
    assert (
        "structured_outputs"
        not in parse_completion(
            {"model": "m", "prompt": "x", "response_format": {"type": "text"}}, "m"
        ).params
    )


CITY = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
WEATHER = {
    "type": "function",
    "function": {"name": "weather", "description": "Weather in a city", "parameters": CITY},
}
ASK = [{"role": "user", "content": "Weather in Paris?"}]


def chat_call(**body):
    return parse_chat({"model": "m", "messages": ASK, "tools": [WEATHER], **body}, "m", render)


def test_tool_choice_decides_the_constraint_and_the_parse():
    named = chat_call(tool_choice={"type": "function", "function": {"name": "weather"}})
    assert named.params["structured_outputs"] == {"json": WEATHER["function"]["parameters"]}
    message = completion_body(named, "m", [Choice('{"city": "Paris"}', "stop")], Usage())["choices"][0]
    [call] = message["message"]["tool_calls"]
    assert call["function"] == {"name": "weather", "arguments": '{"city": "Paris"}'} and call["id"]
    assert message["message"]["content"] is None and message["finish_reason"] == "tool_calls"
    required = chat_call(tool_choice="required")
    items = required.params["structured_outputs"]["json"]["items"]["anyOf"]
    assert items[0]["properties"]["name"] == {"const": "weather"}
    assert "maxItems" not in required.params["structured_outputs"]["json"]
    assert (
        chat_call(tool_choice="required", parallel_tool_calls=False).params["structured_outputs"]["json"][
            "maxItems"
        ]
        == 1
    )
    answer = json.dumps([{"name": "weather", "parameters": {"city": "Oslo"}}])
    [call] = completion_body(required, "m", [Choice(answer, "stop")], Usage())["choices"][0]["message"][
        "tool_calls"
    ]
    assert call["function"] == {"name": "weather", "arguments": '{"city": "Oslo"}'}
    auto = chat_call()
    assert "structured_outputs" not in auto.params and auto.tools.choice == "auto"
    text = 'Let me look.\n<tool_call>\n{"name": "weather", "arguments": {"city": "Rome"}}\n</tool_call>'
    message = completion_body(auto, "m", [Choice(text, "stop")], Usage())["choices"][0]["message"]
    assert message["content"] == "Let me look." and json.loads(
        message["tool_calls"][0]["function"]["arguments"]
    ) == {"city": "Rome"}
    plain = completion_body(auto, "m", [Choice("It is sunny.", "stop")], Usage())["choices"][0]
    assert plain["message"] == {"role": "assistant", "content": "It is sunny."}
    assert plain["finish_reason"] == "stop"
    unknown = '<tool_call>{"name": "nosuch", "arguments": {}}</tool_call>'
    assert (
        completion_body(auto, "m", [Choice(unknown, "stop")], Usage())["choices"][0]["message"]["content"]
        == unknown
    )


@pytest.mark.parametrize("body, words", [
    ({"tool_choice": {"type": "function", "function": {"name": "nosuch"}}}, "not among the tools"),
    ({"tool_choice": "sometimes"}, "tool_choice must be"),
    ({"tools": [{"type": "function"}]}, r"tools\[0\] must be"),
    ({"tools": [], "tool_choice": "required"}, "tool_choice needs tools"),
    ({"tool_choice": "required", "response_format": {"type": "json_object"}}, "both constrain"),
])  # fmt: skip
def test_bad_tools_are_named(body, words):
    with pytest.raises(OpenAIError, match=words):
        chat_call(**body)


def test_tool_messages_and_calls_reach_a_template_without_tools_as_text():
    from preble_backend.frontend.tool_calls import chat_turns

    paris = {"name": "weather", "arguments": '{"city": "Paris"}'}
    history = [*ASK, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": paris}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]  # fmt: skip
    call = chat_call(messages=history)
    turns = chat_turns([{k: v for k, v in m.items()} for m in history], call.tools, False)
    assert turns[0]["role"] == "system" and '"name": "weather"' in turns[0]["content"]
    call_text = '<tool_call>\n{"name": "weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    assert turns[2] == {"role": "assistant", "content": call_text}
    assert turns[3] == {"role": "user", "content": "<tool_response>\nsunny\n</tool_response>"}
    [kept] = [t for t in chat_turns(history, call.tools, True) if t.get("tool_calls")]
    assert kept["tool_calls"][0]["function"]["arguments"] == {"city": "Paris"}  # objects, for HF templates


def test_tool_stream_holds_back_what_may_be_a_call():
    from preble_backend.frontend.tool_calls import ToolStream

    stream = ToolStream(chat_call().tools)
    out = [stream.feed(t) for t in ("Sure", ". <tool", '_call>{"name": "weather", ', '"arguments": {}}')]
    assert out == ["Sure", ". ", "", ""]
    content, [call] = stream.finish()
    assert content is None and call["function"] == {"name": "weather", "arguments": "{}"}
    plain = ToolStream(chat_call().tools)
    assert plain.feed("a <") == "a " and plain.feed("b") == "<b" and plain.finish() == ("", [])


def test_n_choices_each_have_an_index():
    call = parse_completion({"model": "m", "prompt": "x", "n": 3}, "m")
    body = completion_body(call, "m", [Choice("a", "stop"), Choice("b", "length")], Usage())
    assert [(c["index"], c["text"], c["finish_reason"]) for c in body["choices"]] == [
        (0, "a", "stop"),
        (1, "b", "length"),
    ]
    assert chunk_body(call, "m", "b", None, index=2)["choices"][0]["index"] == 2


def test_the_served_model_answers_to_its_name_and_to_preble():
    served = Served("smollm2", aliases=("preble",))
    for name in ("smollm2", "preble"):
        call = parse_completion({"model": name, "prompt": "x"}, served)
        assert completion_body(call, served, [Choice("y", "stop")], Usage())["model"] == "smollm2"
    with pytest.raises(OpenAIError, match="serves `smollm2` or `preble`"):
        parse_completion({"model": "gpt-4", "prompt": "x"}, served)
