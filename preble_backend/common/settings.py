"""What every configuration shares: the KV page size and prefill chunk engines and routers
agree on by default, settings declared once with their documentation (``setting``), and parsing
``config.pbtxt`` string parameters into a config dataclass."""

from __future__ import annotations

from dataclasses import MISSING, Field, field, fields
from pathlib import Path

DEFAULT_PAGE_SIZE = 16  # tokens per KV page: the engines' paging and the routers' matching unit
DEFAULT_CHUNK_SIZE = 512  # prefill tokens per engine pass: E2 P/D prices a prefill engine's passes by it
ATTENTION_BACKENDS = ("auto", "torch", "sdpa", "triton", "flashinfer")
ROLES = ("prefill", "decode", "both")  # what an engine serves in prefill/decode disaggregation
DEFAULT_REPOSITORY = Path(__file__).resolve().parents[2] / "model_repository"  # what preble serve serves
MAX_INPUT_BYTES = 4 << 20  # the router's largest text_input (its max_input_bytes by default)
MAX_BODY_BYTES = 32 << 20  # the front's largest HTTP request: 8x the router's largest text_input
_EXPECTED = {"int": "an integer", "float": "a number", "bool": "true or false"}


def setting(default=MISSING, *, doc: str) -> Field:
    """A config field with the one line that documents it (the repository writer prints
    it above the parameter in ``config.pbtxt``)."""
    return field(default=default, metadata={"doc": doc})


def setting_doc(cls, name: str) -> str:
    return next(f.metadata["doc"] for f in fields(cls) if f.name == name)


def parse_strings(cls, values: dict[str, str], what: str) -> dict[str, object]:
    """String parameters as the dataclass's types, naming any unknown or bad key."""
    types = {f.name: f.type for f in fields(cls)}
    unknown = sorted(set(values) - set(types))
    if unknown:
        raise ValueError(f"unknown {what} parameter(s): {', '.join(unknown)}")
    parsed: dict[str, object] = {}
    for key, raw in values.items():
        kind = types[key]
        try:
            if kind == "int":
                parsed[key] = int(raw)
            elif kind == "float":
                parsed[key] = float(raw)
            elif kind == "bool":
                if raw.lower() not in ("true", "false", "1", "0"):
                    raise ValueError
                parsed[key] = raw.lower() in ("true", "1")
            else:
                parsed[key] = raw
        except ValueError:
            raise ValueError(f"{key}={raw!r} is invalid: expected {_EXPECTED.get(kind, kind)}") from None
    return parsed


def check_roles(roles: list[str] | tuple[str, ...]) -> None:
    """Refuse, by name, a layout that cannot serve: an unknown role, roles on a single
    engine, decoding engines with no engine that prefills for them, or none that decodes."""
    bad = [r for r in roles if r not in ROLES]
    if bad:
        raise ValueError(f"engine role {bad[0]!r} is invalid: expected one of {', '.join(ROLES)}")
    if set(roles) == {"both"}:
        return
    if len(roles) < 2:
        raise ValueError("engine roles need two engines or more: one engine prefills and decodes alone")
    if not any(r in ("decode", "both") for r in roles):
        raise ValueError("no engine decodes: give at least one engine the role decode or both")
    if not any(r in ("prefill", "both") for r in roles):
        raise ValueError("decode engines without a prefill role anywhere: give an engine the role prefill")
