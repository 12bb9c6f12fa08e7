"""Engine and router configuration: every tunable, its default, and the range it must
fall in.

The Triton models build these from their ``config.pbtxt`` parameters, so each check names
the parameter key exactly as a user writes it there.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

ATTENTION_BACKENDS = ("auto", "torch", "triton", "flashinfer")
DTYPES = ("auto", "float32", "float16", "bfloat16")
DEFAULT_CPU_KV_TOKENS = 32768


@dataclass
class EngineConfig:
    model_path: str
    dtype: str = "auto"
    device: str = "cpu"
    page_size: int = 16
    max_num_tokens: int = 0  # KV capacity in tokens; 0 = derive from kv_memory_fraction
    kv_memory_fraction: float = 0.85  # of free GPU memory after weights (CUDA only)
    chunk_size: int = 512  # prefill token budget per iteration
    max_running_requests: int = 256
    priority_groups: int = 10  # P
    priority_quota: int = 10  # k: group g admits (g + 1) * k per round
    enable_prefix_caching: bool = True
    attention_backend: str = "auto"  # torch on CPU, triton (kernels/) on CUDA

    def __post_init__(self) -> None:
        def check(ok: bool, key: str, accepted: str) -> None:
            if not ok:
                raise ValueError(f"{key}={getattr(self, key)!r} is invalid: expected {accepted}")

        check(bool(self.model_path), "model_path", "a local model directory")
        check(self.dtype in DTYPES, "dtype", f"one of {', '.join(DTYPES)}")
        check(self.device == "cpu" or self.device.startswith("cuda"), "device", "cpu or cuda[:i]")
        ps = self.page_size
        check(ps >= 1 and ps & (ps - 1) == 0 and ps <= 256, "page_size", "a power of two in [1, 256]")
        check(self.max_num_tokens == 0 or self.max_num_tokens >= ps, "max_num_tokens", "0 or >= page_size")
        check(0 < self.kv_memory_fraction < 1, "kv_memory_fraction", "a number in (0, 1)")
        check(self.chunk_size >= 1, "chunk_size", "an integer >= 1")
        check(self.max_running_requests >= 1, "max_running_requests", "an integer >= 1")
        check(1 <= self.priority_groups <= 100, "priority_groups", "an integer in [1, 100]")
        check(self.priority_quota >= 1, "priority_quota", "an integer >= 1")
        check(
            self.attention_backend in ATTENTION_BACKENDS,
            "attention_backend",
            f"one of {', '.join(ATTENTION_BACKENDS)}",
        )

    @classmethod
    def from_strings(cls, values: dict[str, str]) -> EngineConfig:
        """Parse string parameters (as config.pbtxt holds them), naming any bad key."""
        return cls(**_parse_strings(cls, values, "engine"))


@dataclass
class RouterConfig:
    model_path: str = "tiny"  # the tokenizer: the engines' model
    engines: str = "preble_engine_0,preble_engine_1"  # local names and grpc://host:port/model
    policy: str = "e2"
    cost_model: str = "tiny_cpu"
    page_size: int = 16  # the engines' KV page size: prompts are matched per page
    max_inflight: int = 1024  # requests forwarded to engines at once
    max_queue: int = 1024  # admitted requests waiting for a forwarding slot; past it, UNAVAILABLE
    max_input_bytes: int = 4 << 20  # a larger text_input is refused before tokenization
    health_interval_s: float = 1.0  # how often each engine is probed and its process checked
    health_timeout_s: float = 10.0  # an engine that does not answer a probe this long is down

    def __post_init__(self) -> None:
        for key in ("page_size", "max_inflight", "max_input_bytes"):
            if getattr(self, key) < 1:
                raise ValueError(f"{key}={getattr(self, key)!r} is invalid: expected an integer >= 1")
        if self.max_queue < 0:
            raise ValueError(f"max_queue={self.max_queue!r} is invalid: expected an integer >= 0")
        for key in ("health_interval_s", "health_timeout_s"):
            if not getattr(self, key) > 0:
                raise ValueError(f"{key}={getattr(self, key)!r} is invalid: expected a number > 0")

    @classmethod
    def from_strings(cls, values: dict[str, str]) -> RouterConfig:
        return cls(**_parse_strings(cls, values, "router"))


def _parse_strings(cls, values: dict[str, str], what: str) -> dict[str, object]:
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
            raise ValueError(f"{key}={raw!r} is invalid: expected a {kind}") from None
    return parsed
