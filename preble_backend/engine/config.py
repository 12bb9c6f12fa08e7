"""Engine configuration: every tunable, its default, and the range it must fall in.

The engine model builds it from its ``config.pbtxt`` parameters, so each check names the
parameter key exactly as a user writes it there.
"""

from __future__ import annotations

from dataclasses import dataclass

from preble_backend.common.settings import DEFAULT_PAGE_SIZE, parse_strings
from preble_backend.model.attention import ATTENTION_BACKENDS

DTYPES = ("auto", "float32", "float16", "bfloat16")
DEFAULT_CPU_KV_TOKENS = 32768


@dataclass
class EngineConfig:
    model_path: str
    dtype: str = "auto"
    device: str = "cpu"
    page_size: int = DEFAULT_PAGE_SIZE
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
        return cls(**parse_strings(cls, values, "engine"))
