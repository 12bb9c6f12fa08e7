"""Hostile and careless requests against the real stack (``preble serve``): each class of
input fails its own request with a 4xx that names the problem, and no server dies; a
request that takes two engines down is refused when it comes back; the supervisor's
death takes the whole stack with it."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from server_utils import GENERATE, generate_body, http, serve_stack, wait_for, write_test_repository

from client.triton_client import PrebleClient, PrebleError, open_grpc, stream_infer
from preble_backend.common.procfs import process_alive
from preble_backend.common.structured_outputs import Guide
from preble_backend.router.requests.guide_check import GuideCheck
from preble_backend.serving.protocol import BadRequest

pytestmark = pytest.mark.server

ENGINES = ("preble_engine_0", "preble_engine_1")


def generate(stack, prompt: str = "Hello", **params) -> tuple[int, bytes]:
    status, _, answer = http("POST", stack.url(GENERATE), generate_body(prompt, **params))
    return status, answer


def chat(stack, **fields) -> tuple[int, dict]:
    request = {"model": "preble", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, **fields}
    status, _, answer = http("POST", stack.url("/v1/chat/completions", stack.openai_port),
                             json.dumps(request).encode(), {"Content-Type": "application/json"})  # fmt: skip
    return status, json.loads(answer)


def rules(n: int) -> str:
    """A Lark grammar of ``n`` rules, each calling the next: compiling it recurses n deep."""
    return "start: r0\n" + "\n".join(f'r{i}: "x" r{i + 1}' for i in range(n)) + f'\nr{n}: "y"'


def test_oversized_lists_and_constraints_fail_their_own_request_and_every_engine_lives(stack):
    stubs = {model: stack.engine_stub(model) for model in ENGINES}
    huge_alternation = "|".join(f"w{i}" for i in range(100_000))
    cases = [
        ({"guided_grammar": rules(20_000)}, b"over the limit"),  # crashed the engine that compiled it
        ({"guided_grammar": "start: " + " | ".join(f'"w{i}"' for i in range(100_000))}, b"over the limit"),
        ({"guided_regex": huge_alternation}, b"over the limit"),
        ({"guided_choice": [f"c{i}" for i in range(5000)]}, b"at most 1024 choices"),
        ({"guided_json": {"type": "object", "description": "x" * 70_000}}, b"over the limit"),
        ({"stop": [f"s{i}" for i in range(100_000)]}, b"at most 64 strings"),
        ({"stop": ["x" * 5000]}, b"at most 1024 bytes"),
        ({"stop_token_ids": list(range(1_000_000))}, b"at most 1024 ids"),
        ({"guided_prefix_ids": [1] * 200_000}, b"at most 131072 ids"),
        ({"guided_regex": "("}, b"cannot be compiled"),
    ]

    def neighbour() -> float:
        began = time.monotonic()
        assert generate(stack, "A neighbour's question", max_tokens=32, ignore_eos=True)[0] == 200
        return time.monotonic() - began

    alone = min(neighbour() for _ in range(2))
    outcomes: list = []
    attack = threading.Thread(target=lambda: outcomes.extend(generate(stack, **p) for p, _ in cases))
    attack.start()
    beside = neighbour()
    attack.join(120)
    for (params, words), (status, answer) in zip(cases, outcomes, strict=True):
        assert status == 400 and words in answer, (str(params)[:80], status, answer[:300])
    assert beside < 3 * alone + 2.0, (alone, beside)  # not held behind a compile (it was 8 s)
    tools = [{"type": "function", "function": {"name": f"f{i}"}} for i in range(200)]
    openai_cases = [({"tools": tools}, "at most 128 tools"),
                    ({"n": 32, "max_tokens": 10_000}, "n x max_tokens"),
                    ({"stop": [f"s{i}" for i in range(100)]}, "at most 64 strings")]  # fmt: skip
    for fields, words in openai_cases:
        status, answer = chat(stack, **fields)
        assert status == 400 and words in answer["error"]["message"], (fields.keys(), status, answer)
    status, answer = generate(stack, guided_grammar=rules(2000), max_tokens=8)  # deep, but within bounds
    assert status == 200, answer
    assert json.loads(answer)["text_output"] == "Hello" + "x" * 8  # the answer repeats the prompt
    assert {model: stack.engine_stub(model) for model in ENGINES} == stubs  # no engine restarted


def test_constraints_that_allow_nothing_are_400_naming_them_and_never_a_500(stack):
    """Refused at admission where the bounded checks decide it; otherwise ended mid-answer
    (llguidance-only syntax the static check does not read, a first choice too wide for the
    probe): 400 on the non-streaming APIs, an error event naming it on a stream. No body
    carries the grammar library's state, and every engine serves on."""
    stubs = {model: stack.engine_stub(model) for model in ENGINES}
    leaks = (b"<state>", b"NoExtensionBias", b"Parser", b"rejected token", b"internal")
    whole = {"type": "object", "properties": {"a": {"$ref": "#"}}, "required": ["a"]}
    chain = {"$defs": {"n": {"$ref": "#/$defs/n"}}, "$ref": "#/$defs/n"}
    refused = [({"guided_regex": r"[^\s\S]"}, b"matches no string"),
               ({"guided_grammar": 'start: a\na: "x" a'}, b"no base case"),
               ({"guided_json": {"$ref": "#"}}, b"no base case"),
               ({"guided_json": chain}, b"no base case"),
               ({"guided_json": whole}, b"no base case")]  # fmt: skip
    for params, words in refused:
        status, answer = generate(stack, max_tokens=8, **params)
        assert status == 400 and b"allows no output: " in answer and words in answer, (params, status, answer)
        assert not any(leak in answer for leak in leaks), answer
    schema = {"type": "json_schema", "json_schema": {"name": "loop", "schema": {"$ref": "#"}}}
    status, answer = chat(stack, response_format=schema)
    assert status == 400 and "structured output json allows no output" in answer["error"]["message"], answer
    undecided = 'start: /[a-z]/ b\nb: "x" b | %json {"$ref": "#"}'
    status, answer = generate(stack, max_tokens=8, temperature=0, guided_grammar=undecided)
    assert status == 400 and b"allows no complete output after 1 token: " in answer, (status, answer)
    assert not any(leak in answer for leak in leaks), answer
    body = generate_body("Hello", max_tokens=8, temperature=0, guided_grammar=undecided)
    status, _, streamed = http("POST", stack.url(GENERATE + "_stream"), body)
    events = [json.loads(line[5:]) for line in streamed.decode().splitlines() if line.startswith("data:")]
    assert "allows no complete output after 1 token" in events[-1]["error"], events
    assert not any(leak.decode() in events[-1]["error"] for leak in leaks)
    status, answer = chat(stack, max_tokens=8, temperature=0, guided_grammar=undecided)
    assert status == 400 and "allows no complete output" in answer["error"]["message"], answer
    request = {"model": "preble", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 8,
               "temperature": 0, "stream": True, "guided_grammar": undecided}  # fmt: skip
    _, _, streamed = http("POST", stack.url("/v1/chat/completions", stack.openai_port),
                          json.dumps(request).encode(), {"Content-Type": "application/json"})  # fmt: skip
    chunks = [line[6:] for line in streamed.decode().splitlines() if line.startswith("data: ")]
    assert chunks[-1] == "[DONE]", chunks
    assert "allows no complete output" in json.loads(chunks[-2])["error"]["message"], chunks
    assert generate(stack, "Still serving", max_tokens=4)[0] == 200
    assert {model: stack.engine_stub(model) for model in ENGINES} == stubs  # no engine restarted


def test_wrongly_typed_generate_inputs_are_400_naming_the_input(stack):
    cases = [({"text_input": 5}, "generate", b"'text_input' must be a string"),
             ({"text_input": "Hi", "stream": "yes"}, "generate_stream", b"'stream' must be a boolean"),
             ({"text_input": "Hi", "stream": True}, "generate", b"needs generate_stream"),
             ({"text_input": "Hi", "sampling_parameters": {"max_tokens": 2}}, "generate", b"a string"),
             ({"text_input": "Hi", "exclude_input_in_output": 1}, "generate", b"must be a boolean"),
             ([1, 2], "generate", b"must be a JSON object")]  # fmt: skip
    for request, kind, words in cases:
        status, _, answer = http("POST", stack.url(f"/v2/models/preble/{kind}"), json.dumps(request).encode())
        assert status == 400 and words in answer, (request, status, answer)


def test_a_pin_to_an_engine_the_router_does_not_have_is_refused(stack):
    def pinned(engine: str) -> tuple[int, bytes]:
        data = json.dumps({"text_input": "Hi", "parameters": {"preble_engine": engine, "max_tokens": 2}})
        status, _, answer = http("POST", stack.url(GENERATE), data.encode())
        return status, answer

    status, answer = pinned("preble_engine_9")
    assert status == 400 and b"preble_engine='preble_engine_9' is invalid" in answer, answer
    status, answer = pinned("preble_engine_1")
    assert status == 200 and json.loads(answer)["instance"] == "preble_engine_1", answer


def test_the_grammar_checker_survives_a_crash_and_a_slow_compile(tiny_model):
    """The checker's worker processes, driven directly: a grammar that overflows the
    compiler's stack (no size limit in the way here) and one over the time limit are
    refused by name, and the next check works on a fresh worker."""
    vocab = json.loads((Path(tiny_model) / "config.json").read_text())["vocab_size"]

    async def run() -> list[str]:
        check = GuideCheck(tiny_model, vocab, timeout_s=2.0, workers=1)
        outcomes = []
        for guide in (Guide("regex", "a|b"), Guide("grammar", rules(20_000)), Guide("regex", "yes|no"),
                      Guide("grammar", "start: " + " | ".join(f'"w{i}"' for i in range(100_000))),
                      Guide("grammar", rules(10))):  # fmt: skip
            try:
                await check.check(guide)
                outcomes.append("ok")
            except BadRequest as exc:
                outcomes.append(str(exc))
        await check.close()
        return outcomes

    outcomes = asyncio.run(run())
    assert outcomes[0] == outcomes[2] == outcomes[4] == "ok", outcomes
    assert "crashed the grammar compiler (exit -11)" in outcomes[1], outcomes
    assert "took more than 2 s to compile" in outcomes[3], outcomes


def test_a_request_on_each_of_two_engines_that_fail_is_failed_and_refused_for_a_while(tmp_path, tiny_model):
    """A long stream's engine is killed (it migrates), then its new engine too: the
    request fails with an error clients do not retry, and the same request sent again is
    refused at once, while another is served."""
    repo = write_test_repository(tmp_path / "repo", cpu_engines=2, compute="emulated", emulated_slowdown=5.0)
    stack = serve_stack(repo)
    try:
        prompt = "A request that every engine it reaches dies under. " * 4
        params = json.dumps({"max_tokens": 600, "ignore_eos": True})
        arrays = {"text_input": np.array([prompt.encode()], dtype=object), "stream": np.array([True]),
                  "sampling_parameters": np.array([params.encode()], dtype=object)}  # fmt: skip
        seen: list[str] = []  # each response's engine ("" where a response does not name it)
        errors: list[str] = []

        def run() -> None:
            channel, stub = open_grpc(f"127.0.0.1:{stack.ports.grpc}")
            try:
                for outputs, _ in stream_infer(stub, "preble", arrays, timeout=180):
                    name = outputs.get("instance")
                    seen.append(name.reshape(-1)[0].decode() if name is not None else "")
            except Exception as exc:  # StreamError: the router's error response
                errors.append(f"{type(exc).__name__}: {exc}")
            finally:
                channel.close()

        thread = threading.Thread(target=run)
        thread.start()
        wait_for(lambda: bool(seen), 60, "the stream's first tokens")
        first = seen[0]
        os.kill(stack.engine_stub(first), signal.SIGKILL)
        killed_at = len(seen)
        wait_for(lambda: len(seen) >= killed_at + 3 or not thread.is_alive(), 60, "the stream going on")
        assert thread.is_alive() and not errors, (errors, seen[-3:])  # it migrated to the other engine
        (second,) = set(ENGINES) - {first}
        os.kill(stack.engine_stub(second), signal.SIGKILL)
        thread.join(120)
        assert errors and "refused for" in errors[0] and "each of the 2 engines" in errors[0], errors
        client = PrebleClient(grpc_url=f"127.0.0.1:{stack.ports.grpc}")
        with pytest.raises(PrebleError, match="refused for"):
            client.stream_grpc(prompt, json.loads(params))
        again = json.dumps({"text_input": prompt, "sampling_parameters": params}).encode()
        status, _, answer = http("POST", stack.url(GENERATE), again)
        assert status == 400 and b"refused for" in answer, answer  # not retryable
        wait_for(lambda: generate(stack, "Another request")[0] == 200, 90, "the engines serving again")
    finally:
        stack.stop()


def test_killing_preble_serve_takes_every_process_of_the_stack_with_it(tmp_path, tiny_model):
    repo = write_test_repository(tmp_path / "repo", cpu_engines=2)
    stack = serve_stack(repo)
    ours = stack.pids()
    assert len(ours) >= 1 + 1 + 3 * 2, ours  # serve, the front, three servers and their stubs
    os.kill(stack.process.pid, signal.SIGKILL)
    stack.process.wait(10)
    deadline = time.monotonic() + 10
    while any(process_alive(p) for p in ours) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [p for p in ours if process_alive(p)]
    again = serve_stack(repo, ports=stack.ports, openai_port=stack.openai_port)  # the same ports are free
    again.stop()
