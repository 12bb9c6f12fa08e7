"""What ``preble bench`` runs and records: its configuration, each request of a trace,
and each request's outcome; shared by the bench's loop (``bench.py``) and its transports
(``bench_transports.py``), which fill outcomes as answers stream in."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class BenchRequest:
    arrival: float  # seconds after the run starts
    prompt: str
    max_tokens: int
    input_ids: list[int] | None = None  # the prompt as an engine takes it (``direct``)
    after: int | None = None  # a conversation's previous turn: sent think_s after its answer
    think_s: float = 0.0
    group: str = ""  # the workload's sharing unit (a document in loogle and shifting_docs)


@dataclass
class Outcome:
    sent: float
    first_token: float | None = None
    finished: float | None = None
    output_tokens: int = 0
    input_tokens: int = 0
    cached_tokens: int = 0
    instance: str = ""
    error: str | None = None


@dataclass
class BenchConfig:
    url: str = "127.0.0.1:8001"  # the server's gRPC endpoint; comma-separated: router replicas
    model: str = "preble"
    workload: str = "toolbench"
    trace: str | None = None  # a JSONL trace: its own arrivals, prompts and max_tokens
    requests: int = 100
    rates: list[float] = field(default_factory=lambda: [1.0, 2.0, 4.0])
    policies: list[str] = field(default_factory=lambda: ["e2", "round_robin"])
    repeats: int = 1
    scale: float = 0.4  # prompt lengths × scale: the paper's traces fit a small model's context
    tokenizer: str | None = None  # size prompts in this model's tokens (else ~words)
    seed: int = 0
    timeout_s: float = 600.0
    stall_s: float = 60.0  # no token from any open request this long: the server is gone
    transport: str = "grpc"  # grpc (streaming) | sse (HTTP generate_stream)
    http_url: str = "127.0.0.1:8000"  # the server's HTTP endpoint (sse)
    direct: str = ""  # an engine model: also run the trace straight to it, as policy "direct"
    api_key: str | None = None  # the server's API key (requests)
    admin_key: str | None = None  # the server's admin key (switching policies)

    @property
    def urls(self) -> list[str]:
        """Each router replica's endpoint (one server: one), requests spread over them in turn."""
        return [u.strip() for u in self.url.split(",") if u.strip()]
