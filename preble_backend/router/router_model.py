"""The router model ``preble``: Triton's vLLM-backend I/O in front of the engine instances.

As in Triton's vLLM backend, ``execute`` only reads and validates each request and hands
it to the router's event loop, which runs on its own thread; a response thread sends.
On the loop, a task per request is admitted (or refused at once with ``UNAVAILABLE`` when
``max_inflight + max_queue`` are admitted), tokenized (on a small thread pool), routed
with the global scheduler's policy, forwarded to the chosen engine (on this router's one
gRPC stream to it, at this server's endpoint for a local engine) and its detokenized
answer queued for the response thread. One loop carries every stream: a thread per request spent the router's
cores on wake-ups and GIL hand-offs at a thousand streams. The policy lives on the loop
and needs no lock. Engine reports on final responses keep the policy's view of every
engine's cache and load current. An engine monitor watches the engines: one that dies is
routed around, its requests end with an error at once, and its cache is forgotten.

What the router knows of its engines, and its verdicts on them, live in
``cluster/router_state.py``; the engines may change while it serves
(``cluster/membership.py`` adds and removes them as ``engines/discovery.py`` finds them);
a request whose engine dies moves on as ``cluster/migration.py`` decides.

Which thread makes which ``pb_utils`` call is listed in docs/SERVING.md.
"""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
import traceback
import uuid
from concurrent.futures import ThreadPoolExecutor
from contextlib import aclosing
from pathlib import Path

import numpy as np
import triton_python_backend_utils as pb_utils

from preble_backend.router.cluster.admin_control import AdminControl, admin_request
from preble_backend.router.cluster.membership import Membership
from preble_backend.router.cluster.migration import Migration
from preble_backend.router.cluster.router_state import FirstProbes, RouterState
from preble_backend.router.cluster.tenant_shares import ClusterShares
from preble_backend.router.config import RouterConfig
from preble_backend.router.engines.discovery import Discovery
from preble_backend.router.engines.engine_client import (
    EngineClient,
    EngineError,
    EngineRefused,
    EngineUnavailable,
    LocalEngine,
    make_engine_client,
)
from preble_backend.router.engines.engine_monitor import EngineMonitor
from preble_backend.router.engines.event_feed import EventFeed
from preble_backend.router.engines.loopback import check_local_engines, server_grpc_url
from preble_backend.router.requests.answer import Answer
from preble_backend.router.requests.flights import Flight, Flights
from preble_backend.router.requests.guide_check import GuideCheck, vocab_size
from preble_backend.router.requests.prefill_leg import PrefillLegs
from preble_backend.router.requests.quarantine import Quarantine
from preble_backend.router.requests.responder import Responder
from preble_backend.router.requests.token_budgets import TokenBudgets
from preble_backend.router.router_metrics import FAILURES, METRICS
from preble_backend.serving.backend_utils import (
    config_parameters,
    error_response,
    exit_with_server,
    read_inputs,
    require_decoupled,
    resolve_model_path,
    send_error,
)
from preble_backend.serving.drain_signal import mark_drained, watch_for_drain
from preble_backend.serving.metrics import Metrics
from preble_backend.serving.protocol import (
    ROUTER_INPUTS,
    BadRequest,
    GenerateRequest,
    decode_report,
    names,
    parse_generate,
)
from scheduler.nvml_load import LoadView
from scheduler.policies import make_policy
from scheduler.policy import FinishInfo, InstanceLoad, RoutingRequest

INPUTS = names(ROUTER_INPUTS)
FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
SHUTTING_DOWN = "the server is shutting down"


class TritonPythonModel(RouterState):
    """Triton's entry point: requests in, answers out, over ``RouterState``."""

    def initialize(self, args: dict) -> None:
        from transformers import AutoTokenizer

        exit_with_server()
        model_config = json.loads(args["model_config"])
        require_decoupled(model_config)
        self.config = config = RouterConfig.from_strings(config_parameters(model_config))
        model_dir = resolve_model_path(config.model_path, args["model_repository"])
        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        self.guide_check = GuideCheck(str(model_dir), vocab_size(model_dir, self.tokenizer),
                                      config.guided_compile_timeout_s)  # fmt: skip
        self.discovery = Discovery(config.engines, config.engines_dns, config.engines_file,
                                   config.discovery_interval_s, pb_utils.Logger.log_warn)  # fmt: skip
        self.server_url = lambda: config.server_grpc_url or server_grpc_url()
        self.engines: list[EngineClient] = [
            make_engine_client(entry, self.server_url) for entry in self.discovery.current
        ]
        self.membership = Membership(self, self.discovery.current)
        self.admin = AdminControl(self)
        self.migration = Migration(self)
        self.legs = PrefillLegs(self)
        local = [e.name for e in self.engines if isinstance(e, LocalEngine)]
        check_local_engines(Path(args["model_repository"]).parent, local, config.page_size)
        self.policy = make_policy(config.policy, len(self.engines), self.policy_facts())
        self.load_view = LoadView([None] * len(self.engines))  # GPUs learnt from engine reports
        self.load_view.start()
        self.loads = [InstanceLoad() for _ in self.engines]
        self.first_probes = FirstProbes(len(self.engines))
        self.feeds = [EventFeed() for _ in self.engines]  # this router's cursor in each event log
        self.quarantine = Quarantine(config.poison_ttl_s)
        self.tasks: set[asyncio.Task] = set()  # one per admitted request
        self.metrics = Metrics({"model": args["model_name"]}, METRICS)
        self.budgets = TokenBudgets()  # the tenants' tokens_per_minute, over every router
        self.tenant_shares = ClusterShares(metrics=self.metrics, budgets=self.budgets)  # as engines report it
        self.flights = Flights(config.max_inflight, config.max_queue, self.tenant_shares.shares)
        for engine in self.engines:
            self.metrics.gauge("preble_router_engine_up", 1, {"engine": engine.name})
        self.metrics.gauge("preble_router_engines", len(self.membership.members))
        # pb_utils.TritonError exists once the stub runs, not when this module is imported
        self.failure_reasons = {getattr(pb_utils.TritonError, code): r for code, r in FAILURES.items()}
        self.metrics.count("preble_router_rejected_total", 0)  # every series exists from the start
        for reason in FAILURES.values():  # at zero, with the label a refusal before routing has
            labels = {"policy": self.policy.name, "reason": reason, "engine": "none"}
            self.metrics.count("preble_router_failures_total", 0, labels)
        self.responder = Responder(_response, error_response, FINAL, pb_utils.Logger.log_error)
        self.tokenize_pool = ThreadPoolExecutor(2, thread_name_prefix="preble-tokenize")
        self.loop = asyncio.new_event_loop()
        self.loop_thread = threading.Thread(target=self.loop.run_forever, name="preble-loop", daemon=True)
        self.loop_thread.start()
        self.monitor = EngineMonitor(
            self.engines, self._on_loop(self._engine_down), self._on_loop(self._engine_up),
            config.health_interval_s, config.health_timeout_s, pb_utils.Logger.log_warn,
            on_load=self._probe_answered, probe_fields=self.tenant_shares.probe_fields,
        )  # fmt: skip
        self.draining = False
        self.discovery.start(self._on_loop(self.membership.change))
        self._stopping = threading.Event()
        threading.Thread(target=self._watch_once_serving, name="preble-watch", daemon=True).start()
        watch_for_drain(self._on_loop(lambda deadline_s: self.loop.create_task(self._drain(deadline_s))),
                        self._stopping)  # fmt: skip
        pb_utils.Logger.log_info(
            f"preble router: policy {self.policy.name} over {[e.name for e in self.engines]}, "
            f"max_inflight {config.max_inflight}, max_queue {config.max_queue}"
        )

    def _probe_answered(self, instance: int, load: dict) -> None:
        """The monitor's thread: the engine's costs are fitted here; the rest of the
        answer is learnt on the loop."""
        try:
            self.calibrate(instance, load)
        except Exception as exc:  # a fit must never cost an engine its probe
            pb_utils.Logger.log_error(f"preble router: fitting engine {instance}'s costs failed: {exc!r}")
        self._on_loop(self._engine_load)(instance, load)

    def _watch_once_serving(self) -> None:
        """Start the engine monitor once this server's gRPC endpoint listens (local engines
        are reached there), not at the first request: an engine that dies before any
        traffic must be seen too, and readiness must say so."""
        while not self._stopping.is_set():
            try:
                host, _, port = self.server_url().rpartition(":")
                with socket.create_connection((host, int(port)), timeout=1):
                    pass
            except (OSError, ValueError):
                self._stopping.wait(0.5)
                continue
            self.monitor.start()
            return

    def execute(self, requests):
        self.monitor.start()  # once the server serves: its gRPC endpoint reaches the local engines
        for request in requests:
            sender = request.get_response_sender()
            try:
                if (admin := admin_request(request.parameters())) is not None:
                    asyncio.run_coroutine_threadsafe(self.admin.run(sender, admin), self.loop)
                    continue
                req = parse_generate(
                    read_inputs(request, INPUTS), request.parameters(), self.config.max_input_bytes
                )
            except (BadRequest, ValueError) as exc:  # AdminRefused among them
                send_error(sender, str(exc), pb_utils.TritonError.INVALID_ARG)
                self._count_failure(pb_utils.TritonError.INVALID_ARG)
                continue
            asyncio.run_coroutine_threadsafe(self._serve(sender, req, time.monotonic()), self.loop)
        return None

    def _on_loop(self, fn):
        """``fn`` called on the event loop, from any thread."""
        return lambda *args: self.loop.call_soon_threadsafe(fn, *args)

    # ---- a request's task, on the event loop ------------------------------------------------

    async def _serve(self, sender, req: GenerateRequest, arrival: float) -> None:
        if self.draining:
            self.responder.refuse(sender, SHUTTING_DOWN, pb_utils.TritonError.UNAVAILABLE)
            return
        if (refusal := self.quarantine.refusal(req.prompt, req.params_json)) is not None:
            self.responder.refuse(sender, refusal, pb_utils.TritonError.INVALID_ARG)
            self._count_failure(pb_utils.TritonError.INVALID_ARG)
            return
        flight = self.flights.admit(sender, req.tenant_name)
        if flight is None:
            self.metrics.count("preble_router_rejected_total", 1)
            self.responder.refuse(sender, self.flights.capacity_message(), pb_utils.TritonError.UNAVAILABLE)
            return
        task = asyncio.current_task()
        self.tasks.add(task)
        self.tenant_shares.opened(req.tenant_name, req.tenant_weight)
        try:
            if not await flight.wait_for_slot():
                return
            if req.params.guide is not None:  # compiled in a checker process first: no engine crashes
                await self.guide_check.check(req.params.guide)
            routing = await self.loop.run_in_executor(self.tokenize_pool, self._routing_request, req)
            if flight.closed:  # ended while it was tokenized (the server is shutting down)
                return
            answer, params_json = Answer(req, self.tokenizer, len(routing.input_ids)), req.params_json
            failures = 0  # engines that failed while this request ran on them
            await self.first_probes.wait(self.config.health_timeout_s)  # their roles and KV known
            while not flight.closed:
                engine = self._place(flight, routing, arrival, req.engine, req.prefill_engine)
                if failures and not await self.migration.answers(flight, engine):
                    continue  # it was down before the request reached it: that is no failure of its
                try:
                    leg = flight.prefill
                    kv = await self.legs.run(leg, routing, req.tenant) if leg is not None else None
                    await self._forward(flight, req, routing, engine, arrival, answer, params_json, kv)
                    return
                except EngineUnavailable as exc:
                    self.monitor.suspect(flight.instance, str(exc))
                    failures += 1
                    if 2 <= failures > self.config.migration_limit and not flight.client_gone:
                        raise self.migration.poisoned(req, failures, str(exc)) from None
                    if not self.migration.may_migrate(flight, req, answer, failures - 1):
                        raise
                    routing, params_json = self.migration.continued(flight, req, routing, answer, str(exc))
                    await asyncio.sleep(0)  # the monitor's verdict first: the policy routes around it
        except (BadRequest, ValueError, EngineRefused) as exc:
            self._fail(flight, str(exc), pb_utils.TritonError.INVALID_ARG)
        except EngineUnavailable as exc:
            if flight.instance is not None:
                self.monitor.suspect(flight.instance, str(exc))
            self._fail(flight, str(exc), pb_utils.TritonError.UNAVAILABLE)
        except EngineError as exc:
            self._fail(flight, str(exc), pb_utils.TritonError.INTERNAL)
        except Exception as exc:
            pb_utils.Logger.log_error(f"preble router: {traceback.format_exc()}")
            self._fail(flight, f"internal error: {exc}", pb_utils.TritonError.INTERNAL)
        finally:
            self.settle(flight)
            self.tasks.discard(task)
            self.tenant_shares.closed(req.tenant_name)

    def _place(self, flight: Flight, routing: RoutingRequest, arrival: float, pin: str | None,
               prefill_pin: str | None = None) -> EngineClient:  # fmt: skip
        """Route the request with the policy, or to the engine it is pinned to while that
        one is up, and record the placement."""
        if not self.policy.live:
            raise EngineUnavailable("no engine is available: every engine has failed")
        if pin and all(e.name != pin for e in self.engines):
            names = ", ".join(e.name for e in self.engines)
            raise BadRequest(f"request parameter preble_engine={pin!r} is invalid: this router's engines are "
                             f"{names}")  # fmt: skip
        pinned = next((i for i in self.policy.live if self.engines[i].name == pin), None) if pin else None
        if pinned is not None:
            decision = self.policy.place(routing, pinned)
        else:
            decision = self.policy.select(routing, self.loads)
        self.loads[decision.instance].in_flight += 1
        flight.instance, flight.routing, flight.prefill = decision.instance, routing, decision.prefill
        self.legs.pin(flight, routing, prefill_pin)
        engine = self.engines[decision.instance]
        policy = {"policy": self.policy.name}
        labels = {**policy, "branch": decision.branch, "engine": engine.name, "tenant": flight.tenant}
        self.metrics.count("preble_router_decisions_total", 1, labels)
        self.metrics.observe("preble_router_queue_time_seconds", time.monotonic() - arrival, policy)
        return engine

    def _routing_request(self, req: GenerateRequest) -> RoutingRequest:
        """The prompt tokenized and hashed per page, on a tokenizer thread: a long prompt
        would hold the loop, and every stream on it, for milliseconds. Its tokens count
        against its tenant's tokens_per_minute."""
        ids = self.tokenizer(req.prompt).input_ids
        if not ids:
            raise BadRequest("input 'text_input' encodes to no tokens")
        self.budgets.admit(req.tenant_name, req.tokens_per_minute, len(ids))
        routing = RoutingRequest(uuid.uuid4().hex, ids, req.params)
        routing.chain(self.config.page_size)
        return routing

    async def _forward(self, flight: Flight, req: GenerateRequest, routing: RoutingRequest, engine,
                       arrival: float, answer: Answer, params_json: str,
                       kv: dict | None) -> None:  # fmt: skip
        """Stream the engine's answer back to the client (``kv``: its prompt's KV offered)."""
        instance = flight.instance
        cancelled = False
        start, first_token_at = time.monotonic(), None
        cursor = self.feeds[instance].cursor
        stream = engine.generate(routing.request_id, routing.input_ids, params_json, cursor, kv, req.tenant)
        async with aclosing(stream):
            async for resp in stream:
                self.monitor.progress(instance)
                if first_token_at is None and resp.token_ids:
                    first_token_at = time.monotonic()
                if not cancelled and (flight.client_gone or flight.closed):  # or ended elsewhere
                    cancelled = True
                    await engine.abort(routing.request_id)  # keep reading: the final response confirms it
                delta = answer.add(resp)
                if resp.final:
                    batch, load = decode_report(resp.report) if resp.report else (None, {})
                    self._learn(instance, engine, load)
                    ttft = None if first_token_at is None else first_token_at - start  # the engine's
                    flight.engine_finished = True
                    info = FinishInfo(self._mirror(instance, batch), load, ttft, answer.num_output)
                    self.policy.on_finish(instance, routing, info)
                    self.gauge_cached(instance)
                    self._observe(engine.name, arrival, first_token_at, answer, resp.num_cached_tokens)
                if cancelled:
                    continue
                if req.stream and (delta or resp.final):
                    self.responder.send(flight, answer.outputs(delta, resp, engine.name), resp.final)
                elif resp.final:
                    self.responder.send(flight, answer.outputs(answer.full_text(), resp, engine.name), True)
                else:
                    self.responder.probe(flight)  # nothing to send: is the client still there?
        if cancelled:
            self._fail(flight, "request was cancelled", pb_utils.TritonError.CANCELLED)
        elif not flight.closed:
            raise EngineError(f"engine {engine.name} ended the stream without a final response")

    # ---- shutdown ---------------------------------------------------------------------------

    async def _drain(self, deadline_s: float) -> None:
        """``preble serve`` is stopping: refuse new requests, give the open ones until the
        deadline, end the rest with a message their clients read, then say so."""
        self.draining = True
        pb_utils.Logger.log_info(f"preble router: draining ({len(self.flights.all())} open, {deadline_s:g}s)")
        deadline = time.monotonic() + deadline_s
        while self.flights.all() and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        await self._fail_all()
        while self.tasks and time.monotonic() < deadline + 5:  # their last responses are queued
            await asyncio.sleep(0.05)
        mark_drained()

    def finalize(self) -> None:
        """End what is still open: the flights first (so that their clients read why), then
        every stream to an engine (the monitor cancels them), which ends the tasks waiting
        on one; then the loop, and the response thread once it has sent what is queued."""
        self._stopping.set()
        self.discovery.stop()
        asyncio.run_coroutine_threadsafe(self._fail_all(), self.loop).result(timeout=10)
        self.monitor.stop()  # cancels every engine's streams
        asyncio.run_coroutine_threadsafe(self._end_tasks(), self.loop).result(timeout=15)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.loop_thread.join(timeout=5)
        if not self.loop_thread.is_alive():
            self.loop.close()
        self.tokenize_pool.shutdown(wait=False, cancel_futures=True)
        self.responder.stop()
        self.load_view.stop()
        for engine in self.engines:
            engine.close()
        self.metrics.close()

    async def _fail_all(self) -> None:
        for flight in self.flights.all():
            self._fail(flight, SHUTTING_DOWN, pb_utils.TritonError.UNAVAILABLE)

    async def _end_tasks(self, timeout_s: float = 5.0) -> None:
        """Wait for the tasks, whose streams are cancelled; cancel any left; close the
        streaming channels."""
        if self.tasks:
            _, pending = await asyncio.wait(set(self.tasks), timeout=timeout_s)
            for task in pending:
                task.cancel()
            await asyncio.gather(*pending, return_exceptions=True)
        for engine in self.engines:
            await engine.aclose()
        await self.guide_check.close()


def _response(outputs: dict[str, np.ndarray]):
    return pb_utils.InferenceResponse(output_tensors=[pb_utils.Tensor(n, v) for n, v in outputs.items()])
