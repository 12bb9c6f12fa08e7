"""The engine: requests in, streamed tokens out, one model iteration per ``step``.

Callers on any thread ``add_request`` and ``abort``; both only enqueue (validation is
done on the caller's thread, so bad input raises there and never reaches the loop). The
iteration loop runs either on the caller (``generate``, tests) or on the engine's own
thread (``start``), as Triton's vLLM backend runs its engine: ``execute`` only enqueues.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future

import torch

from preble_backend.common.cache_event import EventBatch
from preble_backend.common.fair_share import DEFAULT_TENANT
from preble_backend.common.procfs import pin_process
from preble_backend.common.sampling_params import SamplingParams
from preble_backend.engine.cache.event_log import EventLog
from preble_backend.engine.cache.sliding_windows import window_report
from preble_backend.engine.config import EngineConfig
from preble_backend.engine.outputs import guided
from preble_backend.engine.outputs.sampling import SamplerState, sample_one, token_logprobs
from preble_backend.engine.runners.cost_facts import cost_facts, pass_costs
from preble_backend.engine.runners.emulated_runner import EmulatedRunner
from preble_backend.engine.runners.kv_capacity import kv_pages
from preble_backend.engine.runners.model_runner import ModelRunner, device_facts
from preble_backend.engine.runners.tp_ranks import RankLost
from preble_backend.engine.runners.warm_up import warm_up
from preble_backend.engine.scheduling.local_scheduler import ScheduledBatch, make_local_scheduler
from preble_backend.engine.scheduling.request import Request, RequestOutput, Status
from preble_backend.engine.scheduling.stop_checker import StopChecker

log = logging.getLogger("preble.engine")


class Engine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        if config.cpu_cores and config.device == "cpu":  # an instance of its own: its cores
            missing = set(config.cores()) - os.sched_getaffinity(0)
            if missing:
                raise ValueError(
                    f"cpu_cores={config.cpu_cores!r} is invalid: core(s) {sorted(missing)} are not "
                    f"available here ({sorted(os.sched_getaffinity(0))})"
                )
            pin_process(config.cores())
            torch.set_num_threads(len(config.cores()))
        if config.compute == "emulated":
            self.runner = EmulatedRunner(config.model_path, config.cost_model, config.emulated_slowdown)
        else:
            c = config
            self.runner = ModelRunner(c.model_path, c.dtype, c.device, c.attention_backend,
                                      c.tensor_parallel_size, graph_batch=c.graph_batch())  # fmt: skip
        self.model_config = self.runner.cfg
        pages, window_pages = kv_pages(config, self.runner)
        self.pool = self.runner.make_pool(pages, config.page_size, window_pages=window_pages)
        host_pages = config.host_pages(self.pool.num_pages)
        host = self.runner.make_pool(host_pages, config.page_size, host=True) if host_pages else None
        self.scheduler = make_local_scheduler(self.pool, config, host)
        self.cache = self.scheduler.blocks.cache
        self.events = EventLog()  # what every router mirroring this cache reads
        self.stops = StopChecker(config.model_path, self.model_config.eos_token_ids)
        self.pass_costs = pass_costs(self.model_config)  # what its passes cost: E2's online fit
        self.cost_facts = cost_facts(config, self.runner.device, self.runner.dtype)
        self._requests: dict[str, Request] = {}
        self._inbox: deque[Request] = deque()
        self._aborts: deque[str] = deque()
        self._calls: deque[tuple[Callable[[], object], Future]] = deque()
        self._wake = threading.Condition()
        self._guided: guided.GuidedDecoding | None = None  # built on the first guided request
        self._thread: threading.Thread | None = None
        self._stopping = False
        self.num_finished = 0
        self._step_started: float | None = None  # when the running iteration began
        self.on_fatal: Callable[[BaseException], None] | None = None  # the engine cannot go on

    # ---- the request API (any thread) -----------------------------------------------------

    def add_request(
        self, request_id: str, prompt_ids: list[int], params: SamplingParams | dict | None = None,
        callback: Callable[[RequestOutput], None] | None = None,
        tenant: tuple[str, float | None] = (DEFAULT_TENANT, None), received: bool = False,
    ) -> None:  # fmt: skip
        """Queue a request (served from ``tenant``'s share, of that weight: None keeps the
        one it had; ``received``: its prompt's KV came from a prefill instance); raise
        ``ValueError`` naming the problem if it can never run."""
        if not isinstance(params, SamplingParams):
            params = SamplingParams.from_dict(params)
        self.validate(request_id, prompt_ids, params)
        req = Request(request_id=request_id, prompt_ids=[int(t) for t in prompt_ids], params=params,
                      sampler=SamplerState.create(params, self.runner.device), callback=callback,
                      matcher=self._matcher(params), tenant=tenant[0], tenant_weight=tenant[1],
                      received=received)  # fmt: skip
        with self._wake:
            if request_id in self._requests:
                raise ValueError(f"request id {request_id!r} is already in use")
            self._requests[request_id] = req
            self._inbox.append(req)
            self._wake.notify()

    def validate(self, request_id: str, prompt_ids: list[int], params: SamplingParams) -> None:
        if not prompt_ids:
            raise ValueError("prompt is empty: at least one token is required")
        vocab = self.model_config.vocab_size
        bad = [t for t in prompt_ids if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab]
        if bad:
            raise ValueError(f"token id {bad[0]!r} is outside the vocabulary [0, {vocab})")
        total = len(prompt_ids) + params.max_tokens
        limit = self.model_config.max_context
        if total > limit:
            raise ValueError(
                f"prompt ({len(prompt_ids)} tokens) plus max_tokens ({params.max_tokens}) is "
                f"{total} tokens, over the model's context length of {limit}"
            )
        if total > self.pool.capacity_tokens:
            raise ValueError(
                f"prompt plus max_tokens ({total} tokens) exceeds the KV pool "
                f"({self.pool.capacity_tokens} tokens); raise max_num_tokens"
            )
        if params.stop:
            self.stops.require_tokenizer()

    def _matcher(self, params: SamplingParams):
        """The request's grammar matcher when it asks for structured output (compiled on
        the caller's thread: a constraint that cannot compile is refused here)."""
        if params.guide is None:
            return None
        with self._wake:
            if self._guided is None:
                self._guided = guided.GuidedDecoding(self.config.model_path, self.model_config.vocab_size,
                                              self.stops.eos_token_ids)  # fmt: skip
        return self._guided.matcher_on_own_stack(params.guide, params.guided_prefix_ids)

    def abort(self, request_id: str) -> None:
        with self._wake:
            self._aborts.append(request_id)
            self._wake.notify()

    def run_in_loop(self, fn: Callable[[], object]) -> Future:
        """Run ``fn`` on the loop's thread between iterations (for anything that touches the
        cache or the queues from outside, such as a cache flush)."""
        future: Future = Future()
        with self._wake:
            if self._thread is not None:
                self._calls.append((fn, future))
                self._wake.notify()
                return future
        future.set_result(fn())
        return future

    # ---- the iteration loop ---------------------------------------------------------------

    def has_work(self) -> bool:
        return bool(self._inbox or self._aborts or self._calls or self.scheduler.has_work())

    def step(self) -> None:
        """One iteration: take new requests and aborts, run one batch, stream its tokens."""
        with self._wake:
            inbox, self._inbox = list(self._inbox), deque()
            aborts, self._aborts = list(self._aborts), deque()
            calls, self._calls = list(self._calls), deque()
        for fn, future in calls:
            try:
                future.set_result(fn())
            except Exception as exc:
                future.set_exception(exc)
        for req in inbox:
            self.scheduler.add(req)
        for request_id in aborts:
            req = self._requests.get(request_id)
            if req is not None and req.status is not Status.FINISHED:
                self._finish(req, "abort")
        started = time.perf_counter()
        batch = self.scheduler.schedule()
        if not batch:
            return
        work, replays = batch.work(), self.runner.graph_replays()
        for part, logits, rows in self._forward_isolating(batch):
            self.scheduler.advance(part)
            masked, complete, failed = self._mask_guided([part.requests[i] for i in rows], logits)
            for k, (row, i) in enumerate(zip(logits, rows)):
                req = part.requests[i]
                if k in failed:
                    self._constraint_failed(req, failed[k])
                elif k in complete:
                    self._finish(req, "stop")  # the structured answer is whole
                else:
                    self._sample(req, masked.get(k, row))
        ms, graph = 1000 * (time.perf_counter() - started), self.runner.graph_replays() > replays
        self.pass_costs.add(work, ms, graph)

    def _forward_isolating(
        self, batch: ScheduledBatch
    ) -> list[tuple[ScheduledBatch, torch.Tensor, list[int]]]:
        """Run the batch; if the pass fails, halve it until the requests that make it fail
        are found: they end with the error, the rest run (re-running a pass rewrites the
        same KV slots with the same values). A bad request never fails its batch-mates."""
        try:
            logits, rows = self.runner.forward(batch, self.pool)
            return [(batch, logits, rows)]
        except RankLost:
            raise  # no request's fault: the engine itself is broken
        except Exception as exc:
            if len(batch) == 1:
                log.exception("iteration failed for request %s", batch.requests[0].request_id)
                self._finish(batch.requests[0], "error", error=f"engine iteration failed: {exc}")
                return []
        half = len(batch) // 2
        parts = (
            ScheduledBatch(batch.requests[:half], batch.num_new_tokens[:half]),
            ScheduledBatch(batch.requests[half:], batch.num_new_tokens[half:]),
        )
        return [run for part in parts for run in self._forward_isolating(part)]

    def _mask_guided(self, reqs: list[Request], logits: torch.Tensor) -> tuple[dict, set, dict]:
        """The logits of the guided requests among ``reqs`` (one row each) masked to what
        their grammars allow, the rows whose answer is complete, and those that failed."""
        rows = [(k, req.matcher) for k, req in enumerate(reqs) if req.matcher is not None]
        if not rows:
            return {}, set(), {}
        try:
            return self._guided.mask(logits, rows)
        except Exception:  # the guided requests fail; their batch-mates sample on
            log.exception("structured output masks failed")
            return {}, set(), dict.fromkeys(k for k, _ in rows)

    def _constraint_failed(self, req: Request, why: str | None) -> None:
        """The request's structured output allows nothing more: finish reason ``constraint``,
        an error naming it (fronts answer 400), no token sampled. None: the masks failed."""
        if why is None:
            return self._finish(req, "error", error="structured output masks failed (see the engine's log)")
        message = guided.constraint_message(req.params.guide, len(req.output_ids), why)
        self._finish(req, "constraint", error=message)

    def _sample(self, req: Request, row: torch.Tensor) -> None:
        banned = self.stops.banned(req)  # the mask leaves a token (mask()); bans may take it
        if req.matcher is not None and banned and not bool(guided.tokens_left(row, banned).any()):
            return self._constraint_failed(req, guided.BANNED)
        try:
            token = sample_one(row, req.sampler, banned, req.prompt_ids, req.output_ids)
            logprobs = token_logprobs(row, token, req.params.logprobs) if req.logprobs is not None else None
        except Exception as exc:  # this request's sampling failed: it alone ends
            log.exception("sampling request %s failed", req.request_id)
            self._finish(req, "error", error=f"sampling failed: {exc}")
            return
        if req.matcher is not None:
            allowed = bool(torch.isfinite(row[token])) and token not in banned
            if not (allowed and req.matcher.consume_token(token)):
                return self._constraint_failed(req, guided.ENDLESS if allowed else guided.NO_TOKEN)
        req.output_ids.append(token)
        if logprobs is not None:
            req.logprobs.append(logprobs)
        if req.matcher is not None and req.matcher.is_stopped():  # a stop token ended the structure
            reason = "stop"  # (even with ignore_eos: the grammar allows nothing after it)
        else:
            reason = self.stops.finish_reason(req, self.model_config.max_context)
        if reason is None:
            self._emit(req, [token])
        else:
            self._finish(req, reason, new_tokens=[token])

    def _finish(self, req: Request, reason: str, new_tokens=(), error: str | None = None) -> None:
        self.scheduler.finish(req)
        req.finish_reason = reason
        self.num_finished += 1
        with self._wake:
            self._requests.pop(req.request_id, None)
        self._emit(req, list(new_tokens), error)

    def _emit(self, req: Request, tokens: list[int], error: str | None = None) -> None:
        if req.callback is not None:
            try:
                req.callback(req.output(tokens, error))
            except Exception:
                log.exception("callback of request %s failed; aborting it", req.request_id)
                if req.status is not Status.FINISHED:
                    self.abort(req.request_id)

    def generate(
        self, prompts: list[list[int]], params: SamplingParams | dict | None = None
    ) -> list[list[int]]:
        """Run prompts to completion on the calling thread; returns their output ids."""
        if self._thread is not None:
            raise RuntimeError("generate() runs the loop itself; stop the engine thread first")
        outputs: dict[str, list[int]] = {}

        def collect(out: RequestOutput) -> None:
            outputs.setdefault(out.request_id, []).extend(out.token_ids)

        ids = [f"generate-{id(outputs)}-{i}" for i in range(len(prompts))]
        for rid, prompt in zip(ids, prompts):
            self.add_request(rid, prompt, params, collect)
        while self.has_work():
            self.step()
        self.runner.went_idle()
        return [outputs.get(rid, []) for rid in ids]

    def warm_up(self) -> None:
        """Run the attention paths once before the first request (``runners/warm_up.py``)."""
        warm_up(self)

    # ---- the engine thread ----------------------------------------------------------------

    def start(self) -> None:
        self._stopping = False
        self._thread = threading.Thread(target=self._loop, name="preble-engine", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while True:
            with self._wake:
                if not self._stopping and not self.has_work():
                    self.runner.went_idle()
                while not self._stopping and not self.has_work():
                    self._wake.wait()
                if self._stopping:
                    return
            self._step_started = time.monotonic()
            try:
                self.step()
            except RankLost as exc:  # the loop ends; its owner decides (Triton's model: restart)
                log.error("engine loop stopped: %s", exc)
                if self.on_fatal is not None:
                    self.on_fatal(exc)
                return
            self._step_started = None

    def loop_health(self) -> dict[str, object]:
        """Whether the engine thread runs, and how long it has been inside the current
        iteration (0 between iterations): a stuck loop shows here (any thread may ask)."""
        started = self._step_started
        return {
            "loop_alive": self._thread is not None and self._thread.is_alive(),
            "step_age_s": time.monotonic() - started if started is not None else 0.0,
        }

    def cost_report(self) -> dict:
        """What the engine serves and what its passes cost (any thread): E2's online fit."""
        return {"cost_facts": self.cost_facts, "pass_costs": self.pass_costs.report()}

    def shutdown(self) -> None:
        """Stop the thread; every request still queued or running finishes as ``abort``."""
        if self._thread is not None:
            with self._wake:
                self._stopping = True
                self._wake.notify()
            self._thread.join()
            self._thread = None
        with self._wake:
            pending = list(self._requests)
        for request_id in pending:
            self.abort(request_id)
        self.step()
        self.runner.close()  # a tensor-parallel engine's other ranks

    # ---- observation ----------------------------------------------------------------------

    def stats(self) -> dict[str, int]:
        s, cache = self.scheduler.stats, self.cache
        return {
            **device_facts(self.runner.device), "page_size": self.pool.page_size,
            "chunk_size": self.config.chunk_size,
            "kv_pages_total": self.pool.num_pages, "kv_pages_used": self.pool.num_used,
            "kv_pages_free": self.pool.num_free,
            "kv_pages_cached": cache.num_pages if cache else 0,
            "kv_pages_evictable": cache.num_evictable_pages if cache else 0,
            "waiting": len(self.scheduler.waiting), "running": len(self.scheduler.running),
            "prompt_tokens_computed": s.prompt_tokens_computed,
            "prompt_tokens_cached": s.prompt_tokens_cached,
            "num_preemptions": s.num_preemptions, "requests_finished": self.num_finished,
            **(cache.host.report() if cache and cache.host else {}),
            **window_report(self.pool, self.scheduler.blocks.windows),
            **self.runner.stats(),
        }  # fmt: skip

    def cache_events(self, cursor: str | None) -> EventBatch:
        """The cache events after a reader's ``cursor`` (see ``event_log``), or a snapshot
        of the cache when the log cannot continue from it. Call on the engine's thread,
        between iterations, so that the events and the cache agree."""
        if self.cache is None:
            return self.events.snapshot(list)
        self.events.append(self.cache.drain_events())
        return self.events.read(cursor) or self.events.snapshot(self.cache.snapshot)

    def flush_cache(self) -> int:
        """Evict every unreferenced cached page back to the free list; return how many."""
        if self.cache is None:
            return 0
        freed = self.cache.reset()
        self.scheduler.blocks.free(freed)
        return len(freed)
