"""The OpenAI-compatible front against a real tritonserver, driven by the OpenAI SDK:
completions and chat, whole and streamed, usage with cached tokens, errors in OpenAI's
shape, and a client that vanishes mid-stream."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from server_utils import assert_engine_pages_free, client_for, launch, wait_idle, write_test_repository

from preble_backend.runtime.front_process import start_openai_front
from preble_backend.runtime.launcher import free_port

pytestmark = pytest.mark.server
openai = pytest.importorskip("openai")
ENGINES = ("preble_engine_0", "preble_engine_1")
PROMPT = "The router sends each request to the engine that caches its prefix."
GREEDY = {"temperature": 0, "max_tokens": 12}
IGNORE_EOS = {"ignore_eos": True}


@pytest.fixture(scope="module")
def stack(tmp_path_factory, tiny_model):
    root = tmp_path_factory.mktemp("openai")
    server = launch(write_test_repository(root / "repo"), root / "server.log")
    front = start_openai_front(f"127.0.0.1:{server.ports.grpc}", free_port(), tiny_model, root / "front.log")
    try:
        front.wait_healthy()
        yield server, openai.OpenAI(base_url=front.url, api_key="none", max_retries=0)
        client = client_for(server)
        for engine in ENGINES:
            assert_engine_pages_free(client, engine)
    finally:
        front.stop()
        server.stop()


def test_models_lists_the_served_model(stack):
    import openai

    _, api = stack
    assert [m.id for m in api.models.list().data] == ["preble"]  # named so: no alias beside it
    card = api.models.retrieve("preble")
    assert card.id == "preble" and card.root.endswith("tiny-llama-v2") and card.max_model_len == 4096
    assert card.dtype == "float32" and card.parameters > 4_000_000
    from preble_backend.common.version import __version__

    assert card.served_by == f"preble {__version__}"
    with pytest.raises(openai.NotFoundError):
        api.models.retrieve("gpt-4")


def test_fields_the_server_does_not_know_are_ignored(stack):
    _, api = stack
    extra = {"store": False, "service_tier": "auto", "prompt_cache_key": "k", **IGNORE_EOS}
    done = api.completions.create(model="preble", prompt=PROMPT, max_tokens=3, extra_body=extra)
    assert done.usage.completion_tokens == 3


def test_a_completion_is_the_routers_answer_with_usage(stack):
    server, api = stack
    triton = client_for(server).generate(PROMPT, {**GREEDY, **IGNORE_EOS}, exclude_input_in_output=True)
    done = api.completions.create(model="preble", prompt=PROMPT, extra_body=IGNORE_EOS, **GREEDY)
    [choice] = done.choices
    assert choice.text == triton["text_output"] and choice.finish_reason == "length"
    from transformers import AutoTokenizer

    from preble_backend.model.tiny_model import tiny_model_path

    prompt_tokens = len(AutoTokenizer.from_pretrained(tiny_model_path())(PROMPT).input_ids)
    assert (done.usage.prompt_tokens, done.usage.completion_tokens) == (prompt_tokens, 12)
    assert done.usage.total_tokens == prompt_tokens + 12
    again = api.completions.create(model="preble", prompt=PROMPT, extra_body=IGNORE_EOS, **GREEDY)
    assert again.choices[0].text == choice.text
    assert again.usage.prompt_tokens_details.cached_tokens > 0  # the prefix is cached now


def test_a_streamed_completion_adds_up_to_the_whole_one(stack):
    _, api = stack
    whole = api.completions.create(model="preble", prompt=PROMPT, extra_body=IGNORE_EOS, **GREEDY)
    chunks = list(api.completions.create(model="preble", prompt=PROMPT, stream=True,
                                         stream_options={"include_usage": True}, extra_body=IGNORE_EOS,
                                         **GREEDY))  # fmt: skip
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == whole.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert not chunks[-1].choices and chunks[-1].usage.completion_tokens == 12
    echoed = api.completions.create(model="preble", prompt=PROMPT, echo=True, **GREEDY)
    assert echoed.choices[0].text.startswith(PROMPT)


def test_chat_applies_the_models_template(stack):
    server, api = stack
    from transformers import AutoTokenizer

    from preble_backend.model.tiny_model import tiny_model_path

    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": PROMPT}]
    rendered = AutoTokenizer.from_pretrained(tiny_model_path()).apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True
    )
    triton = client_for(server).generate(rendered, {**GREEDY, **IGNORE_EOS}, exclude_input_in_output=True)
    done = api.chat.completions.create(model="preble", messages=messages, extra_body=IGNORE_EOS, **GREEDY)
    assert done.choices[0].message.role == "assistant"
    assert done.choices[0].message.content == triton["text_output"]
    chunks = list(api.chat.completions.create(model="preble", messages=messages, stream=True,
                                              extra_body=IGNORE_EOS, **GREEDY))  # fmt: skip
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == triton["text_output"]
    assert chunks[-1].choices[0].finish_reason == "length"


@pytest.mark.parametrize(
    "kwargs, error, words",
    [
        ({"temperature": -1}, "BadRequestError", "temperature"),
        ({"best_of": 2}, "BadRequestError", "best_of"),
        ({"extra_body": {"guided_regex": "(unclosed"}}, "BadRequestError", "regex cannot be compiled"),
        ({"model": "gpt-4"}, "NotFoundError", "gpt-4"),
    ],
)
def test_a_bad_request_is_named_in_openais_shape_and_the_next_succeeds(stack, kwargs, error, words):
    _, api = stack
    args = {"model": "preble", "prompt": PROMPT, "max_tokens": 4, **kwargs}
    with pytest.raises(getattr(openai, error)) as info:
        api.completions.create(**args)
    assert words in info.value.body["message"] and info.value.body["type"]
    assert api.completions.create(model="preble", prompt=PROMPT, max_tokens=2).choices[0].text is not None


def test_a_client_that_vanishes_mid_stream_frees_its_pages(stack):
    server, api = stack
    stream = api.completions.create(model="preble", prompt=PROMPT, stream=True, max_tokens=2000,
                                    extra_body=IGNORE_EOS)  # fmt: skip
    next(iter(stream))
    stream.close()  # the HTTP connection goes away; the router aborts the request
    client = client_for(server)
    for engine in ENGINES:
        assert_engine_pages_free(client, engine)


def test_logprobs_of_the_sampled_tokens(stack):
    _, api = stack
    done = api.completions.create(model="preble", prompt=PROMPT, logprobs=2, extra_body=IGNORE_EOS, **GREEDY)
    lp = done.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 12
    for sampled, top in zip(lp.token_logprobs, lp.top_logprobs):
        assert len(top) == 2 and sampled == max(top.values()) <= 0  # greedy: the top token
    messages = [{"role": "user", "content": PROMPT}]
    chat = api.chat.completions.create(model="preble", messages=messages, logprobs=True, top_logprobs=1,
                                       extra_body=IGNORE_EOS, **GREEDY)  # fmt: skip
    content = chat.choices[0].logprobs.content
    assert len(content) == 12 and all(t.top_logprobs[0].logprob == t.logprob for t in content)
    chunks = list(api.completions.create(model="preble", prompt=PROMPT, logprobs=2, stream=True,
                                         extra_body=IGNORE_EOS, **GREEDY))  # fmt: skip
    logprobs = [c.choices[0].logprobs for c in chunks if c.choices and c.choices[0].logprobs]
    streamed = [value for chunk in logprobs for value in chunk.token_logprobs]
    assert streamed == pytest.approx(lp.token_logprobs, abs=1e-4)  # cached prefix: other float sums


VERDICT = {"type": "object", "properties": {"answer": {"enum": ["yes", "no"]},
           "score": {"type": "integer", "minimum": 0, "maximum": 9}}, "required": ["answer", "score"],
           "additionalProperties": False}  # fmt: skip
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object",
           "properties": {"city": {"type": "string", "maxLength": 12}, "unit": {"enum": ["C", "F"]}},
           "required": ["city", "unit"], "additionalProperties": False}}}  # fmt: skip


def test_structured_output_on_both_apis(stack):
    """The tiny model's weights are random: only the grammar makes these answers parse."""
    import jsonschema

    server, api = stack
    fmt = {"type": "json_schema", "json_schema": {"name": "verdict", "schema": VERDICT}}
    messages = [{"role": "user", "content": PROMPT}]
    done = api.chat.completions.create(model="preble", messages=messages, response_format=fmt, max_tokens=40)
    jsonschema.validate(json.loads(done.choices[0].message.content), VERDICT)
    assert done.choices[0].finish_reason == "stop"
    loose = api.completions.create(model="preble", prompt=PROMPT, max_tokens=400, temperature=0,
                                   extra_body={"response_format": {"type": "json_object"}})  # fmt: skip
    assert loose.choices[0].finish_reason == "length" or isinstance(json.loads(loose.choices[0].text), dict)
    triton = client_for(server).generate(PROMPT, {"guided_choice": ["red", "green"], "max_tokens": 5},
                                         exclude_input_in_output=True)  # fmt: skip
    assert triton["text_output"] in ("red", "green")


def test_tool_calls_whole_and_streamed(stack):
    import jsonschema

    _, api = stack
    messages = [{"role": "user", "content": "Weather in Oslo?"}]
    ask = {"model": "preble", "messages": messages, "tools": [WEATHER],
           "tool_choice": {"type": "function", "function": {"name": "get_weather"}}, "max_tokens": 60,
           "temperature": 0}  # fmt: skip
    done = api.chat.completions.create(**ask)
    [call] = done.choices[0].message.tool_calls
    assert call.function.name == "get_weather" and done.choices[0].finish_reason == "tool_calls"
    jsonschema.validate(json.loads(call.function.arguments), WEATHER["function"]["parameters"])
    chunks = list(api.chat.completions.create(**ask, stream=True))
    deltas = [d for c in chunks for d in (c.choices[0].delta.tool_calls or [])]
    assert "".join(d.function.arguments for d in deltas) == call.function.arguments
    assert deltas[0].function.name == "get_weather" and chunks[-1].choices[0].finish_reason == "tool_calls"
    required = api.chat.completions.create(**{**ask, "tool_choice": "required", "parallel_tool_calls": False})
    assert required.choices[0].message.tool_calls[0].function.name == "get_weather"


def test_n_choices_share_one_prefill(stack):
    server, api = stack
    client = client_for(server)
    computed = lambda: sum(wait_idle(client, e)["prompt_tokens_computed"] for e in ENGINES)  # noqa: E731
    before = computed()
    prompt = " ".join([PROMPT] * 8) + " Four samples of one prompt."
    args = {"model": "preble", "prompt": prompt, "max_tokens": 6, "temperature": 1.0, "seed": 7,
            "extra_body": IGNORE_EOS}  # fmt: skip
    done = api.completions.create(n=4, **args)
    spent = computed() - before
    assert [c.index for c in done.choices] == [0, 1, 2, 3]
    assert done.usage.completion_tokens == 24 and done.usage.prompt_tokens > 100
    # one prefill, and each later choice recomputes at most its last, partly filled page
    assert spent < done.usage.prompt_tokens + 3 * 16, (spent, done.usage.prompt_tokens)
    chunks = list(api.completions.create(n=4, stream=True, **args))
    streamed = {i: "".join(c.choices[0].text for c in chunks if c.choices[0].index == i) for i in range(4)}
    assert streamed == {c.index: c.text for c in done.choices}  # choice i samples with seed + i
    assert len(set(streamed.values())) > 1


GENAI_PERF = Path(__file__).resolve().parent.parent / ".venv-genai-perf" / "bin" / "genai-perf"


@pytest.mark.parametrize("endpoint", ["kserve", "chat"])
def test_a_short_genai_perf_profile_runs_clean(stack, tmp_path, tiny_model, endpoint):
    """genai-perf 0.0.16 as docs/SERVING.md shows it: Triton's gRPC streaming with the vLLM
    backend's inputs (max_tokens arrives as a string), and the OpenAI chat endpoint."""
    if not GENAI_PERF.is_file():
        pytest.skip("genai-perf is not installed: make genai-perf (make test does)")
    server, api = stack
    if endpoint == "kserve":
        url, kind = f"127.0.0.1:{server.ports.grpc}", ["--backend", "vllm", "--endpoint-type", "kserve"]
    else:
        url, kind = f"{api.base_url.host}:{api.base_url.port}", ["--endpoint-type", "chat"]
    command = [
        str(GENAI_PERF), "profile", "-m", "preble", *kind, "--streaming", "--url", url,
        "--tokenizer", tiny_model, "--synthetic-input-tokens-mean", "64",
        "--synthetic-input-tokens-stddev", "0",
        "--output-tokens-mean", "16", "--num-prefix-prompts", "2", "--prefix-prompt-length", "128",
        "--concurrency", "2", "--measurement-interval", "3000",
        "--verbose",  # perf_analyzer's own output, else sent to /dev/null, ends up in a failure's message
    ]  # fmt: skip
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    for attempt in range(2):
        artifacts = tmp_path / f"run{attempt}"
        done = subprocess.run([*command, "--artifact-dir", str(artifacts)], capture_output=True, text=True,
                              timeout=300, env=env)  # fmt: skip
        # Twice in full-suite runs on this 2-core host perf_analyzer finished a clean run
        # (every request answered) but left its export file empty or cut at 64 KiB, and
        # genai-perf failed parsing it; alone it never has. That, and only that, runs again.
        said = done.stdout + done.stderr
        unparsed = "profile_export.json" in said and "JSONDecodeError" in said
        if done.returncode == 0 or not unparsed:
            break
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]  # perf_analyzer, genai-perf
    [export] = artifacts.glob("*/profile_export_genai_perf.json")
    stats = json.loads(export.read_text())
    assert stats["request_throughput"]["avg"] > 0 and stats["request_count"]["avg"] >= 4
    assert 0 < stats["time_to_first_token"]["avg"] <= stats["request_latency"]["avg"]


def test_the_responses_api(stack):
    """OpenAI's Responses API, whole and streamed, on the chat machinery: text, a JSON
    schema in text.format, a function call, and what a stateless server refuses."""
    import jsonschema

    _, api = stack
    ask = {"model": "preble", "input": PROMPT, "instructions": "Be brief.", "max_output_tokens": 8,
           "temperature": 0, "extra_body": IGNORE_EOS}  # fmt: skip
    done = api.responses.create(**ask)
    assert done.status == "incomplete" and done.incomplete_details.reason == "max_output_tokens"
    assert done.usage.output_tokens == 8 and done.output_text and done.model == "preble"
    events = list(api.responses.create(**ask, stream=True))
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response.incomplete"
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == done.output_text
    assert [e.sequence_number for e in events] == list(range(len(events)))
    fmt = {"format": {"type": "json_schema", "name": "verdict", "schema": VERDICT}}
    typed = api.responses.create(model="preble", input=PROMPT, text=fmt, max_output_tokens=40)
    jsonschema.validate(json.loads(typed.output_text), VERDICT)
    tool = {"type": "function", "name": "get_weather", "parameters": WEATHER["function"]["parameters"]}
    named = {"type": "function", "name": "get_weather"}
    called = api.responses.create(
        model="preble", input="Weather in Oslo?", tools=[tool], tool_choice=named, max_output_tokens=60
    )
    [item] = called.output
    assert item.type == "function_call" and item.name == "get_weather" and item.call_id
    jsonschema.validate(json.loads(item.arguments), tool["parameters"])
    asked = {"type": "function_call", "call_id": item.call_id, "name": item.name, "arguments": item.arguments}
    answered = {"type": "function_call_output", "call_id": item.call_id, "output": "sunny"}
    follow = [{"role": "user", "content": "Weather in Oslo?"}, asked, answered]
    assert api.responses.create(model="preble", input=follow, max_output_tokens=4).usage.input_tokens > 0
    for kwargs, words in (({"previous_response_id": "resp_1"}, "stores no responses"),
                          ({"tools": [{"type": "web_search"}]}, "only function tools")):  # fmt: skip
        with pytest.raises(openai.BadRequestError, match=words):
            api.responses.create(model="preble", input=PROMPT, **kwargs)
