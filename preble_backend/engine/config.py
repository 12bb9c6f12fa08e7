"""Engine configuration: every tunable, its default, and the range it must fall in.

The engine model builds it from its ``config.pbtxt`` parameters, so each check names the
parameter key exactly as a user writes it there.
"""

from __future__ import annotations

from dataclasses import dataclass

from preble_backend.common.cost_model import CostModel
from preble_backend.common.settings import (
    ATTENTION_BACKENDS,
    DEFAULT_CHUNK_SIZE,
    DEFAULT_PAGE_SIZE,
    ROLES,
    parse_strings,
    setting,
)

DTYPES = ("auto", "float32", "float16", "bfloat16")
COMPUTE = ("model", "emulated")
DEFAULT_CPU_KV_TOKENS = 32768


@dataclass
class EngineConfig:
    model_path: str = setting(
        doc="local HF model dir; 'tiny' = the embedded model; relative = from the repository root"
    )
    dtype: str = setting("auto", doc="auto (fp32 on CPU, bf16 on GPU) | float32 | float16 | bfloat16")
    device: str = setting("cpu", doc="cpu | cuda[:i]; in Triton the instance group decides")
    page_size: int = setting(DEFAULT_PAGE_SIZE, doc="tokens per KV page, a power of two")
    max_num_tokens: int = setting(
        0, doc="KV capacity in tokens; 0 = kv_memory_fraction of free GPU memory (32768 on CPU)"
    )
    kv_memory_fraction: float = setting(0.85, doc="GPU only, used when max_num_tokens is 0")
    window_kv_tokens: int = setting(
        0,
        doc="models with sliding-window layers: their KV pool in tokens (they keep only each request's "
        "window); 0 = half the KV capacity, at least two requests' windows",
    )
    host_kv_tokens: int = setting(
        0, doc="host tier: KV tokens kept in host memory when the device evicts them (0 = off)"
    )
    host_kv_ratio: float = setting(
        0.0, doc="host tier sized as this multiple of the device's KV pages, when host_kv_tokens is 0"
    )
    host_copy_ahead: bool = setting(
        True,
        doc="host tier: beside each forward pass, copy down the chunk_size tokens the device evicts "
        "next, so their eviction waits for no copy (false: each eviction copies in line)",
    )
    chunk_size: int = setting(DEFAULT_CHUNK_SIZE, doc="prefill token budget per iteration (chunked prefill)")
    max_running_requests: int = setting(256, doc="cap on requests in the running batch")
    priority_groups: int = setting(10, doc="P of the priority wait queue")
    priority_quota: int = setting(10, doc="k: group g admits (g + 1) * k requests per round")
    enable_prefix_caching: bool = setting(True, doc="radix prefix cache on/off")
    tensor_parallel_size: int = setting(
        1, doc="ranks the model is split over (heads, MLP; one process each, gloo on CPU, NCCL on GPUs)"
    )
    attention_backend: str = setting(
        "auto", doc="auto (sdpa on CPU, triton on GPU) | torch (the reference) | sdpa | triton | flashinfer"
    )
    cuda_graph_max_batch: int = setting(
        64,
        doc="decode batches up to this size replay CUDA graphs captured at load (CUDA, one rank, "
        "the triton backend; else eager); 0 = always eager",
    )
    cpu_cores: str = setting(
        "", doc="CPU engines: the cores this engine runs on, e.g. 0-1 (its torch threads = their count)"
    )
    compute: str = setting(
        "model", doc="model | emulated (real scheduler and cache, forward pass = a cost-model wait)"
    )
    cost_model: str = setting("mistral7b_a6000", doc="emulated compute: a shipped fit or a JSON path")
    emulated_slowdown: float = setting(
        1.0, doc="emulated compute: each iteration waits this multiple of the cost model's time"
    )
    fair_share: bool = setting(
        True,
        doc="tenants' requests admitted by the service each received (VTC), each tenant's in the "
        "paper's priority order (one tenant: the paper's queue exactly; off: the paper's queue alone)",
    )
    role: str = setting(
        "both",
        doc="prefill/decode disaggregation: prefill (offers its prompts' KV to decode engines) | decode "
        "(takes it) | both (serves whole requests; E2 decides per request where roles differ)",
    )
    kv_transfer: bool = setting(
        False,
        doc="both role: move KV with NIXL too (offer this engine's prompts, take other engines'), so E2 "
        "may prefill a prompt on one such engine and decode it on another, per request; prefill and "
        "decode engines always do",
    )
    kv_transfer_lanes: int = setting(
        2, doc="engines that move KV (a role, or kv_transfer): NIXL agents reading one transfer in parallel"
    )
    kv_transfer_devices: str = setting(
        "lo",
        doc="engines that move KV: the network devices KV moves over (UCX_NET_DEVICES); lo keeps its "
        "listeners on loopback (engines on one host); name NICs (e.g. mlx5_0:1) for engines on several",
    )
    kv_transfer_timeout_s: float = setting(
        5.0, doc="engines that take KV: a read that takes longer has failed, and the request prefills here"
    )
    kv_lease_s: float = setting(
        30.0,
        doc="engines that offer KV: offered pages stay locked until the decode side has read them, at most "
        "this long",
    )
    stream_interval: int = setting(
        16, doc="streaming: at most this many tokens per response (Triton only; see stream_interval_ms)"
    )
    stream_interval_ms: float = setting(
        25.0, doc="streaming: a response at least this often; the first and last tokens go at once"
    )

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
        check(self.host_kv_tokens == 0 or self.host_kv_tokens >= ps, "host_kv_tokens", "0 or >= page_size")
        check(self.window_kv_tokens >= 0, "window_kv_tokens", "an integer >= 0")
        check(0 <= self.host_kv_ratio <= 1000, "host_kv_ratio", "a number in [0, 1000]")
        check(self.chunk_size >= 1, "chunk_size", "an integer >= 1")
        check(self.max_running_requests >= 1, "max_running_requests", "an integer >= 1")
        check(1 <= self.priority_groups <= 100, "priority_groups", "an integer in [1, 100]")
        check(self.priority_quota >= 1, "priority_quota", "an integer >= 1")
        check(1 <= self.tensor_parallel_size <= 64, "tensor_parallel_size", "an integer in [1, 64]")
        check(0 <= self.cuda_graph_max_batch <= 1024, "cuda_graph_max_batch", "an integer in [0, 1024]")
        if self.tensor_parallel_size > 1 and (self.host_kv_tokens or self.host_kv_ratio):
            raise ValueError(
                "host_kv_tokens / host_kv_ratio is invalid with tensor_parallel_size > 1: the host "
                "tier does not yet copy each rank's KV slice"
            )
        check(
            self.attention_backend in ATTENTION_BACKENDS,
            "attention_backend",
            f"one of {', '.join(ATTENTION_BACKENDS)}",
        )

        check(not self.cpu_cores or bool(self.cores()), "cpu_cores", "cores like 0-1,4, or empty")
        check(self.compute in COMPUTE, "compute", f"one of {', '.join(COMPUTE)}")
        check(self.emulated_slowdown > 0, "emulated_slowdown", "a number > 0")
        check(self.stream_interval >= 1, "stream_interval", "an integer >= 1")
        check(self.stream_interval_ms >= 0, "stream_interval_ms", "a number >= 0 (0: every token)")
        check(self.role in ROLES, "role", f"one of {', '.join(ROLES)}")
        if self.moves_kv and not self.enable_prefix_caching:
            what = f"role={self.role!r}" if self.role != "both" else "kv_transfer=true"
            raise ValueError(f"{what} is invalid without the prefix cache: a KV handoff moves "
                             "cached pages (enable_prefix_caching: true)")  # fmt: skip
        check(1 <= self.kv_transfer_lanes <= 16, "kv_transfer_lanes", "an integer in [1, 16]")
        check(self.kv_lease_s > 0, "kv_lease_s", "a number > 0")
        check(self.kv_transfer_timeout_s > 0, "kv_transfer_timeout_s", "a number > 0")
        check(bool(self.kv_transfer_devices.strip()), "kv_transfer_devices", "lo, or network devices")
        if self.compute == "emulated":
            CostModel.load(self.cost_model)  # names a bad fit here, not at the first iteration

    @property
    def moves_kv(self) -> bool:
        """Whether the engine moves KV with NIXL: a prefill or decode engine, or one that
        serves both and is told to (``kv_transfer``)."""
        return self.role != "both" or self.kv_transfer

    def host_pages(self, device_pages: int) -> int:
        """Pages of the host tier beside ``device_pages`` on the device (0: no tier)."""
        if self.host_kv_tokens:
            return self.host_kv_tokens // self.page_size
        return int(device_pages * self.host_kv_ratio)

    def window_pages(self, device_pages: int, window: int) -> int:
        """Pages of the sliding layers' pool beside ``device_pages``, for a ``window``: at
        least what one request can hold (its window and a chunk), else refused by name."""
        ps = self.page_size
        least = -(-(window + self.chunk_size) // ps) + 1
        if self.window_kv_tokens:
            if self.window_kv_tokens // ps < least:
                raise ValueError(
                    f"window_kv_tokens={self.window_kv_tokens} is invalid: the model's sliding window "
                    f"({window}) and a chunk ({self.chunk_size}) need at least {least * ps}"
                )
            return self.window_kv_tokens // ps
        return max(device_pages // 2, 2 * least)

    def graph_batch(self) -> int:
        """The largest decode batch captured: no batch runs more than ``max_running_requests``."""
        return min(self.cuda_graph_max_batch, self.max_running_requests)

    def cores(self) -> list[int]:
        return parse_cores(self.cpu_cores)

    @classmethod
    def from_strings(cls, values: dict[str, str]) -> EngineConfig:
        """Parse string parameters (as config.pbtxt holds them), naming any bad key."""
        return cls(**parse_strings(cls, values, "engine"))


def parse_cores(text: str) -> list[int]:
    """``"0-1,4"`` -> [0, 1, 4]; [] when malformed."""
    cores: list[int] = []
    try:
        for part in text.split(","):
            first, _, last = part.strip().partition("-")
            cores.extend(range(int(first), int(last or first) + 1))
    except ValueError:
        return []
    return sorted(set(c for c in cores if c >= 0))
