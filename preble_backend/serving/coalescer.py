"""Fewer, larger responses per streamed request: an engine's outputs wait here between the
engine thread that makes them and the response thread that sends them.

Each response is a round trip to tritonserver on this side and a gRPC message, a decode
and a relay in the router, so its cost is per response, not per token. Two rules cut
their number without delaying text a client could already have:

- **Whatever is waiting goes together.** A request is queued for sending once; the tokens
  that arrive before the response thread reaches it join the same response (vLLM's output
  coalescing). Idle, each token is its own response; behind, a response carries all that
  piled up, so the backlog cannot grow by a response per token.
- **``stream_interval`` tokens per response** (SGLang's ``--stream-interval``): past the
  first, a request is queued only once this many tokens wait. The first token and the
  final response go at once.
"""

from __future__ import annotations

import dataclasses
import threading
from dataclasses import dataclass, field

from preble_backend.engine.request import RequestOutput


@dataclass
class _Held:
    outs: list[RequestOutput] = field(default_factory=list)
    tokens: int = 0
    queued: bool = False
    sent: bool = False  # a response has gone: the next tokens wait for the interval
    report: str | None = None


class Coalescer:
    def __init__(self, stream_interval: int = 1) -> None:
        self.stream_interval = stream_interval
        self._held: dict[str, _Held] = {}
        self._lock = threading.Lock()

    def add(self, out: RequestOutput, report: str | None = None) -> bool:
        """Hold ``out`` (a final one with its ``report``); True when the caller must queue the
        request for the response thread (it is not queued yet and is due)."""
        with self._lock:
            held = self._held.setdefault(out.request_id, _Held())
            held.outs.append(out)
            held.tokens += len(out.token_ids)
            if out.finished:
                held.report = report
            due = out.finished or not held.sent or held.tokens >= self.stream_interval
            if due and not held.queued:
                held.queued = True
                return True
            return False

    def take(self, request_id: str) -> tuple[RequestOutput, str | None]:
        """Everything held for a queued request, merged into one output, and its report."""
        with self._lock:
            held = self._held[request_id]
            outs, report = held.outs, held.report
            held.outs, held.tokens, held.queued, held.sent = [], 0, False, True
            if outs[-1].finished:
                del self._held[request_id]
        return merge(outs), report


def merge(outs: list[RequestOutput]) -> RequestOutput:
    """Consecutive outputs of one request as one: their tokens (and logprobs) in order, the
    last one's state."""
    if len(outs) == 1:
        return outs[0]
    last = outs[-1]
    logprobs = None
    if any(out.logprobs for out in outs):
        logprobs = [step for out in outs for step in out.logprobs or []]
    return dataclasses.replace(last, token_ids=[t for out in outs for t in out.token_ids], logprobs=logprobs)
