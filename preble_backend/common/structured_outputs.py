"""Structured outputs: what a request's answer must match, in vLLM's words.

Clients name it as vLLM's sampling parameters do: ``structured_outputs`` (an object with
one of ``json``, ``json_object``, ``regex``, ``choice``, ``grammar``), or the older
``guided_json``, ``guided_regex``, ``guided_choice``, ``guided_grammar`` keys. The router
checks the shape; the engine compiles it (``engine/outputs/guided.py``) and refuses what its
grammar library cannot compile, naming the problem.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

KINDS = ("json", "json_object", "regex", "choice", "grammar")
# A constraint's text past this is refused before it is compiled: a 1 MB Lark grammar took
# llguidance 16 s and then a panic; 20,000 chained rules overflowed its stack.
MAX_GUIDE_BYTES = 64 << 10
MAX_CHOICES = 1024
LEGACY_KEYS = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
               "guided_grammar": "grammar"}  # fmt: skip


@dataclass(frozen=True)
class Guide:
    """One constraint: ``kind`` in ``KINDS`` and its text (a JSON schema, a regular
    expression, a JSON list of choices, an EBNF grammar; empty for ``json_object``)."""

    kind: str
    spec: str = ""


def parse_guide(key: str, value) -> Guide:
    """A ``Guide`` from ``structured_outputs`` or a ``guided_*`` key's value; a wrong shape
    is a ``ValueError`` naming the key."""
    if key in LEGACY_KEYS:
        return _one(key, LEGACY_KEYS[key], value)
    if not isinstance(value, dict):
        raise ValueError(f"sampling parameter {key} must be an object with one of {', '.join(KINDS)}")
    given = {k: v for k, v in value.items() if v is not None and v is not False}
    unknown = sorted(set(given) - set(KINDS))
    if unknown:
        raise ValueError(f"sampling parameter {key} has unknown key(s) {', '.join(unknown)}: "
                         f"expected one of {', '.join(KINDS)}")  # fmt: skip
    if len(given) != 1:
        raise ValueError(f"sampling parameter {key} must name exactly one of {', '.join(KINDS)}")
    ((kind, spec),) = given.items()
    return _one(f"{key}.{kind}", kind, spec)


def _one(name: str, kind: str, spec) -> Guide:
    guide = _shape(name, kind, spec)
    size = len(guide.spec.encode())
    if size > MAX_GUIDE_BYTES:
        raise ValueError(f"sampling parameter {name} is {size} bytes: over the limit of {MAX_GUIDE_BYTES}")
    return guide


def _shape(name: str, kind: str, spec) -> Guide:
    if kind == "json_object":
        if spec is not True:
            raise ValueError(f"sampling parameter {name} must be true")
        return Guide("json_object")
    if kind == "json":
        if isinstance(spec, str):
            try:
                spec = json.loads(spec)
            except (json.JSONDecodeError, RecursionError):
                raise ValueError(f"sampling parameter {name} must be a JSON schema (an object)") from None
        if not isinstance(spec, dict | bool):
            raise ValueError(f"sampling parameter {name} must be a JSON schema (an object)")
        return Guide("json", json.dumps(spec))  # the schema's property order is the answer's
    if kind == "choice":
        if not isinstance(spec, list) or not spec or not all(isinstance(c, str) and c for c in spec):
            raise ValueError(f"sampling parameter {name} must be a non-empty list of non-empty strings")
        if len(spec) > MAX_CHOICES:
            raise ValueError(f"sampling parameter {name} must hold at most {MAX_CHOICES} choices, "
                             f"got {len(spec)}")  # fmt: skip
        return Guide("choice", json.dumps(spec))
    if not isinstance(spec, str) or not spec:
        raise ValueError(f"sampling parameter {name} must be a non-empty string")
    return Guide(kind, spec)
