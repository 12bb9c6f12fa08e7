"""Router configuration: every setting of the ``preble`` model, its default, and the
range it must fall in (checked where the router loads, named as in ``config.pbtxt``)."""

from __future__ import annotations

from dataclasses import dataclass

from preble_backend.common.settings import DEFAULT_PAGE_SIZE, parse_strings
from scheduler.policies import POLICIES


@dataclass
class RouterConfig:
    model_path: str = "tiny"  # the tokenizer: the engines' model
    engines: str = "preble_engine_0,preble_engine_1"  # local names and grpc://host:port/model
    policy: str = "e2"
    cost_model: str = "tiny_cpu"
    page_size: int = DEFAULT_PAGE_SIZE  # the engines' KV page size: prompts are matched per page
    max_inflight: int = 1024  # requests forwarded to engines at once
    max_queue: int = 1024  # admitted requests waiting for a forwarding slot; past it, UNAVAILABLE
    max_input_bytes: int = 4 << 20  # a larger text_input is refused before tokenization
    health_interval_s: float = 1.0  # how often each engine is probed and its process checked
    health_timeout_s: float = 10.0  # an engine that does not answer a probe this long is down

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ValueError(f"policy={self.policy!r} is invalid: expected one of {', '.join(POLICIES)}")
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
        """Parse string parameters (as config.pbtxt holds them), naming any bad key."""
        return cls(**parse_strings(cls, values, "router"))
