"""Sampling parameters (the vLLM-backend JSON keys) and their validation: the router
checks them before routing, the engine samples with them."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, fields

_INT_KEYS = ("max_tokens", "min_tokens", "top_k", "seed")
_FLOAT_KEYS = ("temperature", "top_p")
SAMPLING_EPS = 1e-5  # as vLLM: a lower temperature is greedy (dividing by it overflows)
SEED_RANGE = (-(2**63), 2**64 - 1)  # what torch.Generator.manual_seed takes


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 16
    min_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1: no limit, as in vLLM
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if not 0 <= self.min_tokens <= self.max_tokens:
            raise ValueError(
                f"min_tokens must be in [0, max_tokens={self.max_tokens}], got {self.min_tokens}"
            )
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:  # NaN fails this too
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k == 0 or self.top_k < -1:
            raise ValueError(f"top_k must be -1 (off) or >= 1, got {self.top_k}")
        if self.seed is not None and not SEED_RANGE[0] <= self.seed <= SEED_RANGE[1]:
            raise ValueError(f"seed must be a 64-bit integer, got {self.seed}")
        if any(not s for s in self.stop):
            raise ValueError("stop strings must be non-empty")

    @property
    def greedy(self) -> bool:
        return self.temperature < SAMPLING_EPS or self.top_k == 1

    @classmethod
    def from_dict(cls, raw: dict | None) -> SamplingParams:
        """Build from the JSON object clients send; every wrong key or type is named."""
        raw = dict(raw or {})
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(raw) - known)
        if unknown:
            raise ValueError(f"unknown sampling parameter(s): {', '.join(unknown)}")
        kwargs = {}
        for key, value in raw.items():
            if value is None:
                continue
            if key in _INT_KEYS:
                if isinstance(value, bool) or not isinstance(value, int):
                    raise ValueError(f"sampling parameter {key} must be an integer, got {value!r}")
            elif key in _FLOAT_KEYS:
                if isinstance(value, bool) or not isinstance(value, int | float):
                    raise ValueError(f"sampling parameter {key} must be a number, got {value!r}")
                value = float(value)
            elif key == "ignore_eos":
                if not isinstance(value, bool):
                    raise ValueError(f"sampling parameter ignore_eos must be a boolean, got {value!r}")
            elif key == "stop":
                value = (value,) if isinstance(value, str) else value
                if not isinstance(value, list | tuple) or not all(isinstance(s, str) for s in value):
                    raise ValueError("sampling parameter stop must be a string or list of strings")
                value = tuple(value)
            elif key == "stop_token_ids":
                if not isinstance(value, list | tuple) or not all(
                    isinstance(t, int) and not isinstance(t, bool) for t in value
                ):
                    raise ValueError("sampling parameter stop_token_ids must be a list of integers")
                value = tuple(value)
            kwargs[key] = value
        return cls(**kwargs)

    @classmethod
    def from_json(cls, text: str | bytes | None) -> SamplingParams:
        if text is None or (isinstance(text, str | bytes) and not text.strip()):
            return cls()
        try:
            raw = json.loads(text)
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise ValueError(f"sampling_parameters is not valid JSON: {exc}") from None
        except RecursionError:
            raise ValueError("sampling_parameters is not valid JSON: nested too deeply") from None
        if not isinstance(raw, dict):
            raise ValueError("sampling_parameters must be a JSON object")
        return cls.from_dict(raw)
