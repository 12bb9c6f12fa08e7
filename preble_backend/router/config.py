"""Router configuration: every setting of the ``preble`` model, its default, and the
range it must fall in (checked where the router loads, named as in ``config.pbtxt``)."""

from __future__ import annotations

from dataclasses import dataclass

from preble_backend.common.settings import DEFAULT_PAGE_SIZE, MAX_INPUT_BYTES, parse_strings, setting
from scheduler.cost_priors import check_setting
from scheduler.policies import POLICIES


@dataclass
class RouterConfig:
    model_path: str = setting(
        "tiny", doc="tokenizer directory (the engines' model); 'tiny' = the embedded model"
    )
    engines: str = setting(
        "preble_engine_0,preble_engine_1",
        doc="comma-separated engine model names in this server and [name=]grpc://host:port/model remotes",
    )
    engines_dns: str = setting(
        "",
        doc="host:port/model: one engine per address the name resolves to (a Kubernetes headless "
        "Service), re-resolved every discovery_interval_s",
    )
    engines_file: str = setting(
        "", doc="a file of entries in engines' syntax (a mounted ConfigMap), read every discovery_interval_s"
    )
    discovery_interval_s: float = setting(5.0, doc="how often engines_dns and engines_file are read again")
    leave_timeout_s: float = setting(
        30.0, doc="how long an engine that left discovery may finish its requests before they move on"
    )
    server_grpc_url: str = setting(
        "",
        doc="host:port of this server's gRPC endpoint, where the router reaches its local engines; "
        "'' = read from tritonserver's command line",
    )
    policy: str = setting("e2", doc=" | ".join(POLICIES))
    cost_model: str = setting(
        "auto",
        doc="E2's PREFILLTIME/DECODETIME: auto (learnt online per engine from the best prior), "
        "auto:FIT (learnt from FIT), or FIT fixed (a shipped name such as tiny_cpu, or a JSON path)",
    )
    tpot_slo_ms: float = setting(
        0.0,
        doc="engines that move KV: e2 prefills no prompt, whole or as a leg, on an engine where the "
        "requests decoding would then take longer per output token (ms), where another engine can take "
        "it (0: no bound; e2 weighs latency alone)",
    )
    ttft_slo_ms: float = setting(
        0.0,
        doc="engines that move KV: where only one of serving a request whole and prefilling it on a prefill "
        "engine is expected to give its first token within this bound (ms), e2 takes that one (0: no bound; "
        "e2 weighs latency alone)",
    )
    page_size: int = setting(
        DEFAULT_PAGE_SIZE, doc="the engines' KV page size: prompts are matched per page (must equal theirs)"
    )
    max_inflight: int = setting(1024, doc="requests forwarded to engines at once")
    max_queue: int = setting(
        1024, doc="admitted requests waiting for a forwarding slot; beyond, requests get UNAVAILABLE"
    )
    max_input_bytes: int = setting(MAX_INPUT_BYTES, doc="a larger text_input is refused before tokenization")
    health_interval_s: float = setting(
        1.0, doc="how often each engine is probed and its stub process checked"
    )
    health_timeout_s: float = setting(
        10.0, doc="an engine that leaves a health probe unanswered this long is down"
    )
    migration_limit: int = setting(
        1,
        doc="times a request whose engine failed continues on another; one more failure fails it, and an "
        "identical request is refused for poison_ttl_s (0: it fails at once)",
    )
    poison_ttl_s: float = setting(
        600.0, doc="how long a request that was running on each engine that failed is refused when sent again"
    )
    guided_compile_timeout_s: float = setting(
        5.0, doc="a structured output that takes longer to compile (in the router's checker) is refused"
    )

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ValueError(f"policy={self.policy!r} is invalid: expected one of {', '.join(POLICIES)}")
        check_setting(self.cost_model)  # a bad name is refused at load, whatever the policy
        for key in ("page_size", "max_inflight", "max_input_bytes"):
            if getattr(self, key) < 1:
                raise ValueError(f"{key}={getattr(self, key)!r} is invalid: expected an integer >= 1")
        for key in ("tpot_slo_ms", "ttft_slo_ms"):
            if not getattr(self, key) >= 0:
                raise ValueError(f"{key}={getattr(self, key)!r} is invalid: expected a number >= 0 (0: none)")
        for key in ("max_queue", "migration_limit"):
            if getattr(self, key) < 0:
                raise ValueError(f"{key}={getattr(self, key)!r} is invalid: expected an integer >= 0")
        if not (self.engines.strip(" ,") or self.engines_dns or self.engines_file):
            raise ValueError("engines='' is invalid: expected engine names or grpc:// URLs, engines_dns "
                             "or engines_file")  # fmt: skip
        for key in ("health_interval_s", "health_timeout_s", "discovery_interval_s", "leave_timeout_s",
                    "poison_ttl_s", "guided_compile_timeout_s"):  # fmt: skip
            if not getattr(self, key) > 0:
                raise ValueError(f"{key}={getattr(self, key)!r} is invalid: expected a number > 0")

    def policy_facts(self) -> dict:
        """The cluster facts of these settings every policy is offered (``scheduler.policies``)."""
        return {"cost_model": self.cost_model, "page_size": self.page_size, "tpot_slo_ms": self.tpot_slo_ms,
                "ttft_slo_ms": self.ttft_slo_ms}  # fmt: skip

    @classmethod
    def from_strings(cls, values: dict[str, str]) -> RouterConfig:
        """Parse string parameters (as config.pbtxt holds them), naming any bad key."""
        return cls(**parse_strings(cls, values, "router"))
