"""OpenAI requests mapped onto the router's contract, and answers in OpenAI's shapes."""

from __future__ import annotations

import pytest

from preble_backend.frontend.openai_protocol import (
    OpenAIError,
    Usage,
    chunk_body,
    completion_body,
    logprobs_body,
    parse_chat,
    parse_completion,
    usage_chunk,
)


def render(messages):
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
        ({"model": "m", "prompt": "x", "n": 3}, 400, "n must be 1"),
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
    body = completion_body(call, "m", " A", "stop", usage)
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
    body = completion_body(call, "m", "abb", "length", Usage(), STEPS)["choices"][0]["logprobs"]
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
