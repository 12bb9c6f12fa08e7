"""A request's life inside one engine: its tokens, its KV pages and its progress."""

from __future__ import annotations

import enum
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from preble_backend.common.fair_share import DEFAULT_TENANT
from preble_backend.common.sampling_params import SamplingParams
from preble_backend.engine.cache.radix_node import TreeNode
from preble_backend.engine.outputs.sampling import SamplerState, TokenLogprobs


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(frozen=True)
class RequestOutput:
    """What a streaming callback receives: tokens since the last call, and on the last
    call the finish reason."""

    request_id: str
    token_ids: list[int]
    finished: bool
    finish_reason: str | None
    num_prompt_tokens: int
    num_cached_tokens: int
    num_output_tokens: int
    error: str | None = None
    logprobs: list[TokenLogprobs] | None = None  # one per token of token_ids, when asked for
    queue_time_s: float | None = None  # arrival to first admission, once admitted
    first_token_s: float | None = None  # arrival to first output token, on the output carrying it


@dataclass(eq=False)
class Request:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    sampler: SamplerState
    callback: Callable[[RequestOutput], None] | None = None
    arrival: float = field(default_factory=time.monotonic)
    output_ids: list[int] = field(default_factory=list)
    status: Status = Status.WAITING
    finish_reason: str | None = None
    # KV state: page_table[:num_tree_pages] belongs to the radix cache (locked through
    # cache_node); the rest is private to this request.
    page_table: list[int] = field(default_factory=list)
    num_tree_pages: int = 0
    cache_node: TreeNode | None = None
    num_computed: int = 0  # tokens whose K/V are in the pool
    window_from: int = 0  # with sliding layers: the first page whose window page it holds
    num_cached_tokens: int | None = None  # prompt tokens served from cache at first admission
    admitted: float | None = None  # when it first left the wait queue
    num_preemptions: int = 0
    logprobs: list[TokenLogprobs] | None = None  # per output token, when the request asks
    matcher: object | None = None  # structured outputs: the grammar's state (engine/outputs/guided.py)
    tenant: str = DEFAULT_TENANT  # whose share it is served from (engine/scheduling/fair_queue.py)
    tenant_weight: float | None = None  # that tenant's weight, as its request said (None: as it was)
    received: bool = False  # its prompt's KV came from a prefill instance (P/D): it joins the next pass
    held_node: TreeNode | None = None  # received: its prompt's cached pages, locked until first admitted

    def __post_init__(self) -> None:
        if self.params.logprobs is not None and self.logprobs is None:
            self.logprobs = []

    def tokens(self, start: int, stop: int) -> list[int]:
        """Tokens ``[start, stop)`` of prompt + output, without building the whole sequence
        (the model runner asks for one decode token of a long prompt every iteration)."""
        p = len(self.prompt_ids)
        if stop <= p:
            return self.prompt_ids[start:stop]
        if start >= p:
            return self.output_ids[start - p : stop - p]
        return self.prompt_ids[start:] + self.output_ids[: stop - p]

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def num_uncomputed(self) -> int:
        return self.num_tokens - self.num_computed

    def output(self, new_tokens: list[int], error: str | None = None) -> RequestOutput:
        first = bool(new_tokens) and len(new_tokens) == len(self.output_ids)  # it carries the first token
        return RequestOutput(
            request_id=self.request_id,
            token_ids=new_tokens,
            finished=self.status is Status.FINISHED,
            finish_reason=self.finish_reason,
            num_prompt_tokens=len(self.prompt_ids),
            num_cached_tokens=self.num_cached_tokens or 0,
            num_output_tokens=len(self.output_ids),
            error=error,
            logprobs=None if self.logprobs is None else self.logprobs[len(self.logprobs) - len(new_tokens) :],
            queue_time_s=None if self.admitted is None else self.admitted - self.arrival,
            first_token_s=time.monotonic() - self.arrival if first else None,
        )
