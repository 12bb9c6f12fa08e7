"""Constraints that allow nothing, as classes: generated regular expressions that match no
string, Lark grammars whose rules refer to themselves with no base case, JSON schemas that
refer to themselves through parts every instance must have. Each is refused at admission
with a message that names it and carries none of the grammar library's state; what the
bounded checks cannot decide ends mid-answer with finish reason ``constraint``, no token
the mask forbids, every page back, and batch-mates untouched. Satisfiable near-misses of
each class (the same text with a way out) are served."""

from __future__ import annotations

import json
import random

import pytest
import torch

from preble_backend.common.empty_language import lark_empty, schema_empty
from preble_backend.common.sampling_params import SamplingParams
from preble_backend.engine.outputs import guided
from preble_backend.engine.outputs.sampling import SamplerState, sample_one

LEAKS = ("<state>", "NoExtensionBias", "Parser", "lexer_cost", "Too many items", "rejected token")
EMPTY_ATOMS = (r"[^\s\S]", r"[^\d\D]", r"[a&&b]", r"[^\w\W]")


def regex_piece(rng: random.Random, depth: int = 0) -> str:
    """A random regular expression that matches some non-empty strings."""
    atoms = ["a", "b", "[a-c]", "[0-9]", "x"]
    if depth < 2:
        inner = regex_piece(rng, depth + 1)
        atoms += [f"(?:{inner})", f"(?:{inner}|{rng.choice(atoms)})"]
    return "".join(
        rng.choice(atoms) + rng.choice(["", "", "?", "*", "+", "{2}"]) for _ in range(rng.randint(1, 3))
    )


def empty_regex(rng: random.Random) -> str:
    r, e = regex_piece(rng), rng.choice(EMPTY_ATOMS)
    return rng.choice(
        [f"{r}{e}", f"{e}{r}", f"(?:{e})+", f"(?:{r}{e})+", f"(?:{e}|{e}){r}", f"{r}(?:{e}){{2}}"]
    )


def near_regex(rng: random.Random) -> str:
    r, e = regex_piece(rng), rng.choice(EMPTY_ATOMS)
    return rng.choice([f"{r}(?:{e})*", f"(?:{r}|{e})", f"{r}(?:{e})?"])


def lark_cycle(rng: random.Random, way_out: bool, fixes=("base", "optional", "bypass")) -> str:
    """Rules u0..uk that each need another of them (none has a base case), reached from
    start in every alternative; ``way_out`` gives each of them a base case, or start an
    optional form or a bypass (the rules stay dead branches), so the language is not empty."""
    k = rng.randint(1, 4)
    names = [f"u{i}" for i in range(k)]
    lits = ['"a"', '"b"', '"xy"', "WORD", "/[0-9]/"]

    def alternative(pool: list[str]) -> str:
        items = [rng.choice(lits) for _ in range(rng.randint(0, 2))]
        items.insert(rng.randint(0, len(items)), rng.choice(pool) + rng.choice(["", "+", " ~ 2"]))
        return " ".join(items)

    rules = [f"{name}: " + " | ".join(alternative(names) for _ in range(rng.randint(1, 3))) for name in names]
    start = " | ".join(alternative(names) for _ in range(rng.randint(1, 2)))
    if way_out:
        fix = rng.choice(fixes)
        if fix == "base":
            rules = [f'{rule} | "end"' for rule in rules]
        elif fix == "optional":
            start = f"[{start}]"
        else:
            start = f'{start} | "done"'
    return "\n".join([f"start: {start}", *rules, "WORD: /[a-z]+/"])


def schema_cycle(rng: random.Random, way_out: bool) -> dict:
    """A schema whose every instance needs another instance of a schema on a $ref cycle:
    through required properties, arrays of at least one item, allOf; ``way_out`` makes
    one link optional (not required, minItems 0, or a null alternative)."""
    length = rng.randint(1, 3)
    defs, target = {}, lambda i: "#" if i == length else f"#/$defs/d{i}"
    weak = rng.randrange(length + 1) if way_out else -1
    for i in range(length + 1):
        link = {"$ref": target((i + 1) % (length + 1))}
        how = rng.choice(["required", "array", "allOf"])
        if how == "required":
            node = {"type": "object", "properties": {"name": {"type": "string"}, "next": link},
                    "required": ["name", "next"] if i != weak else ["name"]}  # fmt: skip
        elif how == "array":
            node = {"type": "array", "items": link, "minItems": 0 if i == weak else rng.randint(1, 3)}
        else:
            node = {"allOf": [{"description": f"link {i}"}, link]}
            node = {"anyOf": [node, {"type": "null"}]} if i == weak else node
        if i == length:
            return {**node, "$defs": defs}
        defs[f"d{i}"] = node
    raise AssertionError("unreachable")


@pytest.mark.parametrize("seed", range(40))
def test_the_static_checks_find_every_generated_cycle_and_pass_every_way_out(seed):
    rng = random.Random(seed)
    assert lark_empty(lark_cycle(rng, way_out=False)) is not None
    assert lark_empty(lark_cycle(rng, way_out=True)) is None
    assert schema_empty(json.dumps(schema_cycle(rng, way_out=False))) is not None
    assert schema_empty(json.dumps(schema_cycle(rng, way_out=True))) is None


def test_the_static_checks_answer_only_what_they_can_read():
    assert lark_empty('start: %json {"$ref": "#"}') is None  # llguidance's own syntax: undecided
    assert lark_empty('start: a\n_t{x}: x "y"') is None  # a template
    assert schema_empty('{"$ref": "https://example.com/s.json"}') is None  # a remote schema
    assert (
        schema_empty('{"properties": {"a": {"$ref": "#"}}, "required": ["a"]}') is None
    )  # untyped: 1 is one
    long_chain = "start: r0\n" + "\n".join(f'r{i}: "x" r{i + 1}' for i in range(5000)) + '\nr5000: "y"'
    assert lark_empty(long_chain) is None
    assert "and 4994 more" in lark_empty(long_chain.replace('r5000: "y"', 'r5000: "y" r0'))


def random_json(rng: random.Random, depth: int = 0):
    """Any JSON value, keywords of JSON Schema among its keys."""
    keys = ["$ref", "type", "properties", "required", "items", "minItems", "anyOf", "allOf", "oneOf",
            "$defs", "prefixItems", "a", "#"]  # fmt: skip
    leaves = [None, True, False, 0, 1, -3, 2.5, "#", "#/$defs/a", "object", "array", "x", ""]
    if depth > 3 or rng.random() < 0.3:
        return rng.choice(leaves)
    if rng.random() < 0.3:
        return [random_json(rng, depth + 1) for _ in range(rng.randint(0, 3))]
    return {rng.choice(keys): random_json(rng, depth + 1) for _ in range(rng.randint(0, 4))}


@pytest.mark.parametrize("seed", range(300))
def test_the_static_checks_never_raise_on_any_text(seed):
    """Whatever a client sends, the checks answer (a reason or None); the compiler refuses
    what is malformed."""
    rng = random.Random(seed)
    for value in (random_json(rng), {"$defs": {"a": random_json(rng)}, "$ref": "#/$defs/a"}):
        assert schema_empty(json.dumps(value)) is None or "no base case" in schema_empty(json.dumps(value))
    alphabet = ['start', ':', 'a', 'b', '|', '"x"', '(', ')', '[', ']', '?', '*', '+', '~', '2', '..',
                '\n', ' ', '/re/', '%import', '->', 'A', '{', '}', '<[1]>', '//']  # fmt: skip
    text = "start: " + "".join(rng.choice(alphabet) for _ in range(rng.randint(1, 40)))
    assert lark_empty(text) is None or "no base case" in lark_empty(text)


@pytest.fixture(scope="module")
def engine(tiny_model):
    from preble_backend.engine.config import EngineConfig
    from preble_backend.engine.engine import Engine

    return Engine(EngineConfig(model_path=tiny_model, dtype="float32", max_num_tokens=8192))


def run(engine, requests: dict[str, dict]) -> dict[str, list]:
    """Each request to its end in one batch; its outputs."""
    outputs: dict[str, list] = {rid: [] for rid in requests}
    for rid, params in requests.items():
        engine.add_request(rid, [5, 6, 7, 8], params, outputs[rid].append)
    while engine.has_work():
        engine.step()
    return outputs


def refusal(engine, key: str, spec) -> str:
    with pytest.raises(guided.ConstraintError) as caught:
        engine.add_request("refused", [5, 6, 7], {"max_tokens": 8, key: spec}, lambda out: None)
    message = str(caught.value)
    assert not any(leak in message for leak in LEAKS), message
    return message


@pytest.mark.parametrize("seed", range(8))
def test_generated_empty_constraints_are_refused_at_admission_and_near_misses_served(engine, seed):
    from conftest import assert_all_pages_free

    rng = random.Random(1000 + seed)
    for key, spec, kind in [("guided_regex", empty_regex(rng), "regex"),
                            ("guided_grammar", lark_cycle(rng, way_out=False), "grammar"),
                            ("guided_json", schema_cycle(rng, way_out=False), "json")]:  # fmt: skip
        assert refusal(engine, key, spec).startswith(f"structured output {kind} allows no output: "), spec
    # A grammar with a dead branch may still end on it mid-answer (the test below): these have none.
    lark = lark_cycle(rng, way_out=True, fixes=("base",))
    served = {"regex": {"guided_regex": near_regex(rng)}, "lark": {"guided_grammar": lark},
              "json": {"guided_json": schema_cycle(rng, way_out=True)}}  # fmt: skip
    outputs = run(engine, {rid: {"max_tokens": 24, "temperature": 0, **p} for rid, p in served.items()})
    for rid, outs in outputs.items():
        assert outs[-1].finished and outs[-1].error is None, (rid, served[rid], outs[-1])
        assert outs[-1].finish_reason in ("stop", "length")
    assert_all_pages_free(engine)


def test_the_issues_four_examples_are_refused_naming_the_constraint(engine):
    assert "matches no string" in refusal(engine, "guided_regex", r"[^\s\S]")
    assert "rule(s) a, start refer to themselves" in refusal(engine, "guided_grammar", 'start: a\na: "x" a')
    assert "no base case" in refusal(engine, "guided_json", {"$ref": "#"})
    assert "no base case" in refusal(
        engine, "guided_json", {"$defs": {"n": {"$ref": "#/$defs/n"}}, "$ref": "#/$defs/n"}
    )
    whole = {"type": "object", "properties": {"a": {"$ref": "#"}}, "required": ["a"]}
    assert "no base case" in refusal(engine, "guided_json", whole)


def test_what_admission_cannot_decide_ends_mid_answer_as_a_constraint_error(engine, monkeypatch):
    """The grammar's llguidance-only syntax is not read by the static check and its first
    choice is too wide for the probe: the answer ends after its first token, on the
    constraint's own error; a batch-mate runs on as it would alone."""
    from conftest import assert_all_pages_free

    undecided = 'start: /[a-z]/ b\nb: "x" b | %json {"$ref": "#"}'
    alone = run(engine, {"mate": {"max_tokens": 6, "temperature": 0}})["mate"]
    outputs = run(engine, {"g": {"max_tokens": 12, "temperature": 0, "guided_grammar": undecided},
                           "mate": {"max_tokens": 6, "temperature": 0}})  # fmt: skip
    last = outputs["g"][-1]
    assert last.finished and last.finish_reason == "constraint"
    assert last.error.startswith("structured output grammar allows no complete output after 1 token: ")
    assert "no base case" in last.error and not any(leak in last.error for leak in LEAKS)
    assert sum(len(out.token_ids) for out in outputs["g"]) == 1  # the letter; nothing the mask forbids
    assert [t for out in outputs["mate"] for t in out.token_ids] == [
        t for out in alone for t in out.token_ids
    ]
    # With admission's checks off, the empty regex ends at its first mask, no token sampled.
    monkeypatch.setattr(guided.GuidedDecoding, "probe", lambda self, matcher: None)
    outputs = run(engine, {"r": {"max_tokens": 8, "guided_regex": r"ab[^\s\S]"}})["r"]
    assert outputs[-1].finish_reason == "constraint" and not any(out.token_ids for out in outputs)
    assert outputs[-1].error.endswith(f"after 0 tokens: {guided.NO_TOKEN}")
    assert_all_pages_free(engine)


def test_a_mask_whose_every_token_is_banned_ends_the_request_without_sampling(engine, tiny_model):
    """``guided_choice`` allows one token, which ``stop_token_ids`` bans until
    ``min_tokens``: nothing may be sampled, and nothing is."""
    from transformers import AutoTokenizer

    token = AutoTokenizer.from_pretrained(tiny_model).encode("q", add_special_tokens=False)
    assert len(token) == 1
    params = {"max_tokens": 8, "min_tokens": 4, "stop_token_ids": token, "guided_regex": "q+"}
    outputs = run(engine, {"b": params})["b"]
    assert outputs[-1].finish_reason == "constraint" and guided.BANNED in outputs[-1].error
    assert not any(out.token_ids for out in outputs)


@pytest.mark.parametrize("seed", range(200))
def test_the_sampler_never_emits_a_token_the_mask_forbids(seed):
    gen = torch.Generator().manual_seed(seed)
    rng = random.Random(seed)
    row = torch.randn(64, generator=gen) * rng.choice([0.1, 1.0, 30.0])
    allowed = torch.rand(64, generator=gen) < rng.choice([0.02, 0.2, 0.9])
    allowed[rng.randrange(64)] = True
    banned = [t for t in range(64) if rng.random() < 0.1]
    allowed[rng.choice(allowed.nonzero().flatten().tolist())] = True
    masked = row.masked_fill(~allowed, float("-inf"))
    left = guided.tokens_left(masked, banned)
    if not left.any():
        return  # the engine ends such a request before sampling (the test above)
    params = SamplingParams.from_dict({
        "temperature": rng.choice([0.0, 0.5, 1.0, 2.0]), "top_k": rng.choice([-1, 1, 5]),
        "top_p": rng.choice([1.0, 0.5, 0.05]),
        "repetition_penalty": rng.choice([1.0, 1.5]), "frequency_penalty": rng.choice([0.0, 1.0]),
        "presence_penalty": rng.choice([0.0, -1.0]), "seed": seed,
    })  # fmt: skip
    state = SamplerState.create(params, "cpu")
    output_ids = [rng.randrange(64) for _ in range(5)]
    for _ in range(5):
        assert bool(left[sample_one(masked, state, banned, [1, 2, 3], output_ids)])
