"""What the router knows of its engines, and what it does when that changes.

Every per-engine table is indexed by slot (``membership.py`` adds slots as engines join);
the policy holds the global prefix tree and each engine's load history. The verdicts
land here, on the event loop: an engine down (routed around, its cache forgotten, its
streams cancelled) or up again, a final response's report learnt (its cache events
mirrored into the policy, its load snapshot), a request settled or failed, a finished
request's series observed. The router model (``router/router_model.py``) serves requests over
this state; membership and the admin control change it.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import triton_python_backend_utils as pb_utils

from preble_backend.common.cache_event import CacheEvent, EventBatch
from preble_backend.router.cluster.tenant_shares import ClusterShares
from preble_backend.router.config import RouterConfig
from preble_backend.router.engines.engine_client import EngineClient
from preble_backend.router.engines.engine_monitor import EngineMonitor
from preble_backend.router.engines.event_feed import EventFeed
from preble_backend.router.engines.first_probes import FirstProbes
from preble_backend.router.requests.answer import Answer
from preble_backend.router.requests.flights import Flight, Flights
from preble_backend.router.requests.quarantine import Quarantine
from preble_backend.router.requests.responder import Responder
from preble_backend.router.requests.token_budgets import TokenBudgets
from preble_backend.serving.metrics import Metrics
from scheduler.nvml_load import LoadView
from scheduler.policy import FinishInfo, InstanceLoad, Policy


class RouterState:
    """The router's engines and their bookkeeping; ``router_model.TritonPythonModel``
    fills these in ``initialize``."""

    config: RouterConfig
    engines: list[EngineClient]
    loads: list[InstanceLoad]  # what this router has in flight on each, and its last report
    feeds: list[EventFeed]  # this router's cursor in each engine's event log
    load_view: LoadView
    policy: Policy
    monitor: EngineMonitor
    membership: object  # membership.Membership: which slots discovery names now
    flights: Flights
    quarantine: Quarantine
    responder: Responder
    metrics: Metrics
    failure_reasons: dict
    loop: asyncio.AbstractEventLoop
    server_url: Callable[[], str]
    tokenize_pool: ThreadPoolExecutor  # also the pool for blocking calls to engines
    tenant_shares: ClusterShares
    budgets: TokenBudgets
    first_probes: FirstProbes  # the engines it started with, until each is heard from

    def policy_facts(self) -> dict:
        """What every policy is offered about the engines (``scheduler.policies``)."""
        return self.config.policy_facts()

    def _observe(self, engine: str, arrival: float, first_token_at: float | None, answer: Answer,
                 cached: int) -> None:  # fmt: skip
        """A finished request's latencies and token counts, as the client saw them, by tenant too."""
        now, labels = time.monotonic(), {"policy": self.policy.name, "engine": engine,
                                         "tenant": answer.req.tenant_name}  # fmt: skip
        observe = self.metrics.observe
        observe("preble_router_e2e_request_latency_seconds", now - arrival, labels)
        if first_token_at is not None:
            observe("preble_router_time_to_first_token_seconds", first_token_at - arrival, labels)
            if answer.num_output > 1:
                tpot = (now - first_token_at) / (answer.num_output - 1)
                observe("preble_router_time_per_output_token_seconds", tpot, labels)
        observe("preble_router_request_prompt_tokens", answer.num_input_tokens, labels)
        observe("preble_router_request_generation_tokens", answer.num_output, labels)
        self.metrics.count("preble_router_prompt_tokens_total", answer.num_input_tokens, labels)
        self.metrics.count("preble_router_cached_prompt_tokens_total", cached, labels)
        self.budgets.take(answer.req.tenant_name, answer.req.tokens_per_minute, answer.num_output)

    def _count_failure(self, code, engine: str = "none") -> None:
        """A failed request, by reason and by the engine it was placed on ("none": refused
        before routing)."""
        reason = self.failure_reasons.get(code, "internal")
        self.metrics.count("preble_router_failures_total", 1, {"policy": self.policy.name, "reason": reason,
                                                               "engine": engine})  # fmt: skip

    def _fail(self, flight: Flight, message: str, code) -> None:
        if self.responder.fail(flight, message, code):
            engine = "none" if flight.instance is None else self.engines[flight.instance].name
            self._count_failure(code, engine)

    def settle(self, flight: Flight) -> None:
        """The router's bookkeeping for a routed request, once, whoever ends it first."""
        if flight.instance is None or flight.settled:
            return
        flight.settled = True
        self.loads[flight.instance].in_flight -= 1
        if not flight.engine_finished:  # refused or failed: forget the placement
            self.policy.on_finish(flight.instance, flight.routing, FinishInfo())

    def _mirror(self, instance: int, batch: EventBatch | None) -> list[CacheEvent]:
        """The report's cache events this router has not applied yet; on a snapshot the
        policy first drops what earlier events said the engine caches."""
        if batch is None:
            return []
        events, resync = self.feeds[instance].take(batch)
        if resync:
            self.policy.resync(instance)
        return events

    def _learn(self, instance: int, engine: EngineClient, load: dict) -> None:
        """A report's load snapshot; the GPU of an engine on this host is sampled through
        NVML from then on, and what the router last sampled is exported as gauges."""
        self.monitor.learn_pid(instance, load)
        self.load_view.report(instance, load)
        self.load_view.learn_gpu(instance, load, engine.on_this_host)
        snapshot = self.loads[instance].reported = self.load_view.snapshot(instance)
        if "gpu_utilization" in snapshot:
            labels = {"engine": engine.name}
            self.metrics.gauge("preble_router_gpu_utilization", snapshot["gpu_utilization"], labels)
            self.metrics.gauge("preble_router_gpu_memory_fraction", snapshot["gpu_memory_fraction"], labels)

    def gauge_cached(self, instance: int) -> None:
        cached = self.policy.cached_tokens(instance)
        if cached is not None:
            labels = {"engine": self.engines[instance].name}
            self.metrics.gauge("preble_router_cached_pages", cached // self.config.page_size, labels)

    def _engine_down(self, instance: int, reason: str) -> None:
        name = self.engines[instance].name
        pb_utils.Logger.log_error(f"preble router: engine {name} is down ({reason}); routing around it")
        self.metrics.gauge("preble_router_engine_up", 0, {"engine": name})
        self.policy.instance_down(instance)
        self.first_probes.settled(instance)
        self.tenant_shares.forget(instance)
        self.gauge_cached(instance)
        self.feeds[instance].reset()
        if not self.config.migration_limit:  # else each task moves its request elsewhere
            for flight in self.flights.on_instance(instance):
                self._fail(flight, f"engine {name} failed while serving this request: {reason}",
                           pb_utils.TritonError.UNAVAILABLE)  # fmt: skip
                self.settle(flight)
        self.engines[instance].cancel_all()  # ends the tasks waiting on its answers

    def calibrate(self, instance: int, load: dict) -> None:
        """A probe's answer, on the monitor's thread: the policy fits the engine's costs
        there, never on a request's path, and the fits in use are exported when one changed
        (an engine still at its prior may price with a peer's new fit)."""
        policy = self.policy
        if not policy.calibrate(instance, load):
            return
        gauge = self.metrics.gauge
        for fit, engine in zip(policy.cost_fits(), list(self.engines)):
            labels = {"engine": engine.name}
            gauge("preble_router_cost_model_learnt", int(fit.status == "learnt"), labels)
            gauge("preble_router_cost_model_mismatch", int(fit.mismatch), labels)
            gauge("preble_router_cost_fit_passes", fit.passes, labels)
            if fit.error is not None:
                gauge("preble_router_cost_fit_error", fit.error, labels)
            m = fit.model
            for term, value in (("base", m.base_ms), ("prefill_per_token", m.prefill_ms_per_token),
                                ("decode_per_request", m.decode_ms_per_request),
                                ("attention_per_context_token", m.attention_ms_per_context_token),
                                ("decode_step", m.decode_step_ms)):  # fmt: skip
                gauge("preble_router_cost_ms", value, {**labels, "term": term})

    def _engine_load(self, instance: int, load: dict) -> None:
        """A health probe's answer: what the engine is (its KV, its host tier), for
        whichever policy routes now, and for one that replaces it (``AdminControl.fresh_policy``)."""
        self.loads[instance].probed = load
        self.policy.learn(instance, load)
        self.first_probes.settled(instance)
        self.tenant_shares.learn(instance, load)
        self.tenant_shares.publish(self.metrics)

    def _engine_up(self, instance: int) -> None:
        name = self.engines[instance].name
        if self.membership.first_answer(instance):
            pb_utils.Logger.log_info(f"preble router: engine {name} answers; routing to it")
        else:
            pb_utils.Logger.log_info(f"preble router: engine {name} is back; routing to it again")
        self.metrics.gauge("preble_router_engine_up", 1, {"engine": name})
        self.engines[instance].reopen_streams()
        self.policy.instance_up(instance)
