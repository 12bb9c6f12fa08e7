"""Fewer, larger responses per streamed request: an engine's outputs wait here between the
engine thread that makes them and the response thread that sends them.

Each response is a round trip to tritonserver on this side and a gRPC message, a decode
and a relay in the router, so its cost is per response, not per token. Three rules cut
their number without holding text a reader would notice:

- **Whatever is waiting goes together.** A request is queued for sending once; the tokens
  that arrive before the response thread reaches it join the same response (vLLM's output
  coalescing), so a backlog cannot grow by a response per token.
- **A response per ``stream_interval_ms``, or per ``stream_interval`` tokens**, whichever
  comes first (SGLang's ``--stream-interval`` counts tokens only). Checked as each token
  arrives: an engine slower than the interval sends every token at once, and a fast one
  sends a response per interval. The first token and the final response go at once.
- **Nothing waits much longer than the interval**: the response thread's periodic sweep
  sends tokens held past it (a request preempted or stalled between two tokens).
"""

from __future__ import annotations

import dataclasses
import threading
import time
from dataclasses import dataclass, field

from preble_backend.engine.scheduling.request import RequestOutput


@dataclass
class _Held:
    outs: list[RequestOutput] = field(default_factory=list)
    since: float = 0.0  # when the first held output arrived
    last_sent: float | None = None  # None: nothing sent yet, the first token goes at once
    queued: bool = False
    report: str | None = None


class Coalescer:
    def __init__(self, stream_interval: int, stream_interval_ms: float) -> None:
        self.max_tokens = stream_interval
        self.interval_s = stream_interval_ms / 1e3
        self._held: dict[str, _Held] = {}
        self._lock = threading.Lock()

    def add(self, out: RequestOutput, report: str | None = None) -> bool:
        """Hold ``out`` (a final one with its ``report``); True when the caller must queue the
        request for the response thread (it is not queued yet and is due)."""
        now = time.monotonic()
        with self._lock:
            held = self._held.setdefault(out.request_id, _Held())
            if not held.outs:
                held.since = now
            held.outs.append(out)
            if out.finished:
                held.report = report
            due = (
                out.finished
                or held.last_sent is None
                or sum(len(o.token_ids) for o in held.outs) >= self.max_tokens
                or now - held.last_sent >= self.interval_s
            )
            return self._queue(held) if due else False

    def overdue(self) -> list[str]:
        """Requests whose held tokens have waited an interval: each is now queued, and the
        caller must queue it for the response thread."""
        now = time.monotonic()
        with self._lock:
            return [
                request_id
                for request_id, held in self._held.items()
                if held.outs and now - held.since >= self.interval_s and self._queue(held)
            ]

    @staticmethod
    def _queue(held: _Held) -> bool:
        if held.queued:
            return False
        held.queued = True
        return True

    def take(self, request_id: str) -> tuple[RequestOutput, str | None]:
        """Everything held for a queued request, merged into one output, and its report."""
        with self._lock:
            held = self._held[request_id]
            outs, report = held.outs, held.report
            held.outs, held.queued, held.last_sent = [], False, time.monotonic()
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
