"""The Triton model that hosts one engine instance (``preble_engine_<i>``).

As in Triton's vLLM backend: the engine loop runs on its own thread, ``execute`` only
validates and enqueues, and a response thread sends, so sending never stalls the model.
The response thread also watches for cancelled requests and aborts them in the engine,
which frees their pages, and it publishes the engine's load as custom metrics.
"""

from __future__ import annotations

import itertools
import json
import os
import queue
import threading
import time
import uuid
from concurrent.futures import Future

import numpy as np
import triton_python_backend_utils as pb_utils

from preble_backend.engine.config import EngineConfig
from preble_backend.engine.engine import Engine
from preble_backend.engine.scheduling.request import RequestOutput
from preble_backend.engine_server.coalescer import Coalescer
from preble_backend.engine_server.kv_exchange import KVExchange
from preble_backend.engine_server.tenant_ledger import SERVICE, WAITING, TenantLedger
from preble_backend.serving.backend_utils import (
    config_parameters,
    exit_with_server,
    read_inputs,
    require_decoupled,
    resolve_model_path,
    send_error,
    string_tensor,
)
from preble_backend.serving.metrics import Metrics, MetricSpec
from preble_backend.serving.protocol import (
    ENGINE_INPUTS,
    REFUSED,
    encode_report,
    names,
    parse_engine_call,
)

INPUTS = names(ENGINE_INPUTS)
CANCEL_POLL_S = 0.1
FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
CONTROL, TOKENS, LAST = 0, 1, 2  # response-queue priorities: control answers go first
GAUGES = {  # stats key -> (metric name, description)
    "kv_pages_used": ("preble_engine_kv_pages_used", "KV pages in use (running requests and cache)"),
    "kv_pages_free": ("preble_engine_kv_pages_free", "KV pages on the free list"),
    "kv_pages_cached": ("preble_engine_kv_pages_cached", "KV pages held by the radix cache"),
    "kv_host_pages_used": ("preble_engine_kv_host_pages_used", "KV pages held by the host tier"),
    "waiting": ("preble_engine_waiting_requests", "requests in the priority wait queue"),
    "running": ("preble_engine_running_requests", "requests running"),
    "kv_pages_held": ("preble_engine_kv_pages_held", "KV pages a timed-out transfer may still write"),
}
COUNTERS = {  # stats key -> counter name (Prometheus: counters end in _total)
    "prompt_tokens_computed": "preble_engine_prompt_tokens_computed_total",
    "prompt_tokens_cached": "preble_engine_prompt_tokens_cached_total",
    "host_pages_offloaded": "preble_engine_host_pages_offloaded_total",
    "host_pages_loaded": "preble_engine_host_pages_loaded_total",
    "host_loadbacks": "preble_engine_host_loadbacks_total",
    "host_bytes_moved": "preble_engine_host_bytes_moved_total",
    "host_load_s": "preble_engine_host_load_seconds_total",
    "host_pages_short": "preble_engine_host_pages_short_total",
    "host_pages_reused": "preble_engine_host_pages_reused_total",
    "host_pages_copied_ahead": "preble_engine_host_pages_copied_ahead_total",
    "host_pages_loaded_beside": "preble_engine_host_pages_loaded_beside_total",
    "decode_graph_steps": "preble_engine_decode_graph_steps_total",
    "kv_offers": "preble_engine_kv_offers_total",  # prefill role: prompts offered to decode engines
    "kv_takes": "preble_engine_kv_takes_total",  # decode role: offers read from (failed ones too)
    "kv_transfer_failures": "preble_engine_kv_transfer_failures_total",
    "kv_pages_received": "preble_engine_kv_pages_received_total",
    "kv_bytes_received": "preble_engine_kv_bytes_received_total",
    "kv_transfer_s": "preble_engine_kv_transfer_seconds_total",  # reads that succeeded
    # compute emulated: the modelled device's time, and how far the host's own work ran past it
    "emulated_model_s": "preble_engine_emulated_model_seconds_total",
    "emulated_behind_s": "preble_engine_emulated_behind_seconds_total",
}
QUEUE_TIME = "preble_engine_request_queue_time_seconds"
FIRST_TOKEN = "preble_engine_time_to_first_token_seconds"
QUEUE_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
METRICS = [
    *(MetricSpec(name, "gauge", text) for name, text in GAUGES.values()),
    *(MetricSpec(name, "counter", key.replace("_", " ")) for key, name in COUNTERS.items()),
    MetricSpec(
        QUEUE_TIME, "histogram", "arrival to admission out of the wait queue, by tenant", QUEUE_BUCKETS
    ),
    MetricSpec(
        FIRST_TOKEN, "histogram", "arrival at this engine to its first output token, by tenant", QUEUE_BUCKETS
    ),
    MetricSpec(
        SERVICE,
        "counter",
        "the service this engine gave each tenant: prompt tokens computed, cached "
        "tokens and output tokens, weighted as fair_share weighs them (common/fair_share.py)",
    ),
    MetricSpec(WAITING, "gauge", "each tenant's requests in this engine's wait queue"),
]


class TritonPythonModel:
    def initialize(self, args: dict) -> None:
        exit_with_server()
        self.model_config = json.loads(args["model_config"])
        require_decoupled(self.model_config)
        params = config_parameters(self.model_config)
        params["model_path"] = resolve_model_path(params.get("model_path", "tiny"), args["model_repository"])
        if args["model_instance_kind"] == "GPU":
            params.setdefault("device", f"cuda:{args['model_instance_device_id']}")
        self.engine = Engine(EngineConfig.from_strings(params))
        if self.engine.runner.device.type == "cuda":  # compile the kernels now, not in a request
            self.engine.warm_up()
        moves = self.engine.config.moves_kv  # a prefill or decode engine, or both with kv_transfer
        self.kv = KVExchange(self.engine, args["model_name"], pb_utils.Logger.log_warn) if moves else None
        self.metrics = Metrics({"model": args["model_name"]}, METRICS)
        self.tenants = TenantLedger(self.engine, args["model_name"])
        self._counted = dict.fromkeys(COUNTERS, 0)
        self._active: dict[str, object] = {}  # request id -> response sender
        cfg = self.engine.config
        self._held = Coalescer(cfg.stream_interval, cfg.stream_interval_ms)  # outputs not yet sent
        self._responses: queue.PriorityQueue = queue.PriorityQueue()  # (priority, order, item)
        self._order = itertools.count()
        self._response_thread = threading.Thread(
            target=self._response_loop,
            name="preble-responses",
            daemon=True,  # joined in finalize
        )
        self.engine.on_fatal = self._fatal
        self.engine.start()
        self._response_thread.start()
        pb_utils.Logger.log_info(
            f"{args['model_name']}: engine on {self.engine.config.device}, "
            f"{self.engine.pool.num_pages} KV pages of {self.engine.pool.page_size} tokens"
        )

    def _fatal(self, exc: BaseException) -> None:
        """The engine cannot run another pass (a tensor-parallel rank died): the stub exits,
        so that its server is restarted (``preble serve``'s supervisor) while the router
        moves this engine's requests elsewhere."""
        pb_utils.Logger.log_error(f"preble engine: {exc}; exiting so that the engine is restarted")
        os._exit(1)

    def execute(self, requests):
        for request in requests:
            sender = request.get_response_sender()
            try:
                self._submit(request, sender)
            except Exception as exc:
                send_error(sender, f"{REFUSED}{exc}", pb_utils.TritonError.INVALID_ARG)
        return None

    def _submit(self, request, sender) -> None:
        call = parse_engine_call(read_inputs(request, INPUTS), request.request_id() or uuid.uuid4().hex,
                                 request.parameters())  # fmt: skip
        if call.control is not None:
            self._control(call.control, sender)
            return
        if call.request_id in self._active:
            raise ValueError(f"request id {call.request_id!r} is already in use")
        take = (call.kv or {}).get("take") if self.kv is not None else None
        if take is not None:  # refused now if it can never run, not after the transfer
            try:
                self.engine.validate(call.request_id, call.input_ids, call.params)
            except ValueError:
                self.kv.decline(take)  # the prefill side's lease goes now, not when it expires
                raise
        self._active[call.request_id] = sender
        try:
            if take is None:
                self._add(call)
            else:  # the prompt's KV first (or not: then it prefills here), then the request
                self.kv.take(call.input_ids, take, lambda: self._add_taken(call, sender))
        except ValueError:
            self._active.pop(call.request_id, None)
            raise

    def _add(self, call, received: bool = False) -> None:
        offer = self.kv is not None and call.kv == {"offer": True}
        self.engine.add_request(call.request_id, call.input_ids, call.params,
                                lambda out: self._on_output(out, call, offer),
                                (call.tenant, call.tenant_weight), received)  # fmt: skip

    def _add_taken(self, call, sender) -> None:
        """The engine's thread, once the prompt's KV was received or not."""
        try:
            self._add(call, received=True)
        except ValueError as exc:  # its id reused meanwhile
            self._active.pop(call.request_id, None)
            send_error(sender, f"{REFUSED}{exc}", pb_utils.TritonError.INVALID_ARG)

    def _on_output(self, out: RequestOutput, call, offer: bool) -> None:
        """Engine thread: hold the output for the response thread (``Coalescer``), which is
        told once per response; a final one carries the report, read here so that events
        and the load snapshot are consistent with the cache (and a prefill leg's offer of
        its prompt's KV, now cached)."""
        report = None
        if out.finished:
            kv_offer = self.kv.offer(out.request_id, call.input_ids) if offer and out.error is None else None
            report = encode_report(self._stats(), self.engine.cache_events(call.events_since), kv_offer)
            if out.queue_time_s is not None:
                self.metrics.observe(QUEUE_TIME, out.queue_time_s, {"tenant": call.tenant})
        if out.first_token_s is not None:
            self.metrics.observe(FIRST_TOKEN, out.first_token_s, {"tenant": call.tenant})
        if self._held.add(out, report):
            self._put(TOKENS, out.request_id)

    def _control(self, op: dict, sender) -> None:
        """Every answer is sent by the response thread, ahead of token responses (under a
        burst thousands queue: a prober must not mistake that for death). ``health`` is
        answered at once. No control answer carries cache events: those reach each router
        through its own cursor in the engine's event log.
        The others run in the engine loop, between iterations: ``execute`` never waits."""
        if op["op"] == "health":  # a router's copy of the tenants' service comes with it
            self.tenants.take(op.get("shares"), op.get("spent"))
            answer: Future = Future()
            load = {**self._stats(), **self.engine.loop_health(), **self.engine.cost_report()}
            answer.set_result(encode_report({**load, **self.tenants.report()}))
            self._put(CONTROL, (sender, answer))
            return
        if op["op"] == "abort":
            self.engine.abort(op["request_id"])

        def report() -> str:
            if op["op"] == "flush_cache":
                self.engine.flush_cache()
            return encode_report(self._stats())

        self.engine.run_in_loop(report).add_done_callback(lambda done: self._put(CONTROL, (sender, done)))

    def _put(self, priority: int, item) -> None:
        self._responses.put((priority, next(self._order), item))

    def _response_loop(self) -> None:
        poll_s = min(CANCEL_POLL_S, max(self._held.interval_s, 0.005))
        swept = flushed = time.monotonic()
        while True:
            if (now := time.monotonic()) - flushed >= poll_s:  # tokens held past the interval
                for request_id in self._held.overdue():
                    self._put(TOKENS, request_id)
                flushed = now
            try:
                _, _, item = self._responses.get(timeout=poll_s)
            except queue.Empty:
                if (now := time.monotonic()) - swept >= CANCEL_POLL_S:
                    self._sweep()
                    swept = now
                continue
            if item is None:
                return
            if isinstance(item, tuple):  # a control operation's sender and report (a Future)
                self._send_report(*item)
                continue
            out, report = self._held.take(item)
            sender = self._active[out.request_id]
            try:
                self._send(sender, out, report)
            except Exception as exc:  # the client is gone; the engine must not keep its pages
                pb_utils.Logger.log_warn(f"sending {out.request_id} failed ({exc}); aborting it")
                self.engine.abort(out.request_id)
            if out.finished:
                self._active.pop(out.request_id, None)
                self._publish_metrics()

    def _send(self, sender, out: RequestOutput, report: str | None) -> None:
        if out.error is not None:  # a constraint that allows nothing more is the request's fault
            if out.finish_reason == "constraint":
                send_error(sender, f"{REFUSED}{out.error}", pb_utils.TritonError.INVALID_ARG)
            else:
                send_error(sender, out.error)
            return
        tensors = [pb_utils.Tensor("token_ids", np.asarray(out.token_ids, dtype=np.int32))]
        if out.logprobs:
            rows = [[[t, lp, rank] for t, (lp, rank) in step.items()] for step in out.logprobs]
            tensors.append(string_tensor("logprobs", [json.dumps(rows)]))
        flags = 0
        if out.finished:
            tensors += [
                string_tensor("finish_reason", [out.finish_reason or ""]),
                pb_utils.Tensor("num_cached_tokens", np.asarray([out.num_cached_tokens], dtype=np.int32)),
                string_tensor("report", [report or ""]),
            ]
            flags = FINAL
        sender.send(pb_utils.InferenceResponse(output_tensors=tensors), flags=flags)

    def _send_report(self, sender, done) -> None:
        try:
            tensors = [string_tensor("report", [done.result()])]
            sender.send(pb_utils.InferenceResponse(output_tensors=tensors), flags=FINAL)
        except Exception as exc:
            send_error(sender, f"control operation failed: {exc}")

    def _sweep(self) -> None:
        for request_id, sender in list(self._active.items()):
            if sender.is_cancelled():
                self.engine.abort(request_id)
        if self.kv is not None:
            self.kv.sweep()
        self._publish_metrics()

    def _stats(self) -> dict:
        """The engine's load snapshot plus this stub's pid: the router watches the process."""
        kv = self.kv.stats() if self.kv is not None else {}
        return {**self.engine.stats(), "pid": os.getpid(), "role": self.engine.config.role, **kv}

    def _publish_metrics(self) -> None:
        stats = self._stats()
        for key, (name, _) in GAUGES.items():  # the host tier's are 0 without one
            self.metrics.gauge(name, stats.get(key, 0))
        for key, name in COUNTERS.items():
            self.metrics.count(name, stats.get(key, 0) - self._counted[key])
            self._counted[key] = stats.get(key, 0)
        self.tenants.publish(self.metrics)

    def finalize(self) -> None:
        self.engine.shutdown()  # pending requests finish as "abort" and reach the queue
        if self.kv is not None:
            self.kv.close()
        self._put(LAST, None)
        self._response_thread.join()
        self.metrics.close()
