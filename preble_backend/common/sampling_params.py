"""Sampling parameters (the vLLM-backend JSON keys) and their validation: the router
checks them before routing, the engine samples with them.

Values may come as JSON strings, as Triton's vLLM backend accepts them (its own sample
client and genai-perf send ``{"max_tokens": "100", "temperature": "0.1"}``): numbers as
numeric strings, booleans as ``"true"``/``"false"``/``"1"``/``"0"``. Where the vLLM
backend converts loosely we differ: it truncates ``1.5`` to 1, which we refuse, naming the
key; it reads ``"false"`` as true (``bool("false")``), which we read as false.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, fields

from preble_backend.common.structured_outputs import LEGACY_KEYS, Guide, parse_guide

_INT_KEYS = ("max_tokens", "min_tokens", "top_k", "seed", "logprobs")
_FLOAT_KEYS = ("temperature", "top_p", "presence_penalty", "frequency_penalty", "repetition_penalty")
_BOOL_KEYS = ("ignore_eos",)
SAMPLING_EPS = 1e-5  # as vLLM: a lower temperature is greedy (dividing by it overflows)
SEED_RANGE = (-(2**63), 2**64 - 1)  # what torch.Generator.manual_seed takes
MAX_LOGPROBS = 20  # top alternatives per token, as OpenAI's API caps them
# Sizes past which a request is refused (400) before anyone works on it: a 100,000-entry
# stop list held its engine's loop for 16-21 s, a million stop_token_ids for 16 s.
MAX_STOP = 64  # stop strings
MAX_STOP_BYTES = 1024  # per stop string (UTF-8)
MAX_STOP_TOKEN_IDS = 1024
MAX_GUIDED_PREFIX_IDS = 1 << 17  # a migrated guided request's tokens so far


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
    presence_penalty: float = 0.0  # subtracted once from every token already generated
    frequency_penalty: float = 0.0  # subtracted per time a token was generated
    repetition_penalty: float = 1.0  # divides (multiplies, if negative) prompt and output tokens' logits
    logprobs: int | None = None  # None: none; k: the sampled token's and the top k's
    guide: Guide | None = None  # structured outputs: what the answer must match
    # Output tokens already generated under the guide, which the engine's matcher consumes
    # first: the router sends them when it migrates a guided request to another engine.
    guided_prefix_ids: tuple[int, ...] = ()

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
        longest = max((len(s.encode()) for s in self.stop), default=0)
        if len(self.stop) > MAX_STOP or longest > MAX_STOP_BYTES:
            raise ValueError(f"stop must be at most {MAX_STOP} strings of at most {MAX_STOP_BYTES} bytes "
                             f"each, got {len(self.stop)} (the longest {longest} bytes)")  # fmt: skip
        if len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            raise ValueError(f"stop_token_ids must hold at most {MAX_STOP_TOKEN_IDS} ids, "
                             f"got {len(self.stop_token_ids)}")  # fmt: skip
        if len(self.guided_prefix_ids) > MAX_GUIDED_PREFIX_IDS:
            raise ValueError(f"guided_prefix_ids must hold at most {MAX_GUIDED_PREFIX_IDS} ids")
        for key in ("presence_penalty", "frequency_penalty"):
            if not -2 <= getattr(self, key) <= 2:  # NaN fails this too
                raise ValueError(f"{key} must be in [-2, 2], got {getattr(self, key)}")
        if not (self.repetition_penalty > 0 and math.isfinite(self.repetition_penalty)):
            raise ValueError(f"repetition_penalty must be a finite number > 0, got {self.repetition_penalty}")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise ValueError(f"logprobs must be in [0, {MAX_LOGPROBS}], got {self.logprobs}")

    @property
    def greedy(self) -> bool:
        return self.temperature < SAMPLING_EPS or self.top_k == 1

    @property
    def penalized(self) -> bool:
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0)

    @classmethod
    def from_dict(cls, raw: dict | None) -> SamplingParams:
        """Build from the JSON object clients send; every wrong key or type is named."""
        raw = dict(raw or {})
        guides = [k for k in ("structured_outputs", *LEGACY_KEYS) if raw.get(k) is not None]
        if len(guides) > 1:
            both = " and ".join(guides)
            raise ValueError(f"sampling parameters {both} both constrain the output: send one")
        guide = parse_guide(guides[0], raw.pop(guides[0])) if guides else None
        for key in ("structured_outputs", *LEGACY_KEYS):
            raw.pop(key, None)
        known = {f.name for f in fields(cls)} - {"guide"}
        unknown = sorted(set(raw) - known)
        if unknown:
            raise ValueError(f"unknown sampling parameter(s): {', '.join(unknown)}")
        kwargs = {}
        for key, value in raw.items():
            if value is None:
                continue
            if key in _INT_KEYS:
                value = _integer(key, value)
            elif key in _FLOAT_KEYS:
                value = _number(key, value)
            elif key in _BOOL_KEYS:
                value = _boolean(key, value)
            elif key == "stop":
                value = (value,) if isinstance(value, str) else value
                if not isinstance(value, list | tuple) or not all(isinstance(s, str) for s in value):
                    raise ValueError("sampling parameter stop must be a string or list of strings")
                if len(value) > MAX_STOP:
                    raise ValueError(f"stop must be at most {MAX_STOP} strings, got {len(value)}")
                value = tuple(value)
            elif key in ("stop_token_ids", "guided_prefix_ids"):
                if not isinstance(value, list | tuple):
                    raise ValueError(f"sampling parameter {key} must be a list of integers")
                limit = MAX_STOP_TOKEN_IDS if key == "stop_token_ids" else MAX_GUIDED_PREFIX_IDS
                if len(value) > limit:
                    raise ValueError(f"{key} must hold at most {limit} ids, got {len(value)}")
                value = tuple(_integer(key, t) for t in value)
            kwargs[key] = value
        return cls(**kwargs, guide=guide)

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


def _typed(key: str, value, parse, accepted: type | tuple, what: str):
    """``value`` as the key's type: a value of that type (never a bool), or a string that
    parses as one."""
    if isinstance(value, str):
        try:
            return parse(value.strip())
        except ValueError:
            pass
    elif isinstance(value, accepted) and not isinstance(value, bool):
        return parse(value)
    raise ValueError(f"sampling parameter {key} must be {what}, got {value!r}")


def _integer(key: str, value) -> int:
    return _typed(key, value, int, int, "an integer")


def _number(key: str, value) -> float:
    return _typed(key, value, float, (int, float), "a number")


def _boolean(key: str, value) -> bool:
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower() if isinstance(value, str | int) else None
    if text in ("true", "1"):
        return True
    if text in ("false", "0"):
        return False
    raise ValueError(f"sampling parameter {key} must be a boolean, got {value!r}")
