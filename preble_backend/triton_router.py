"""The router model ``preble``: Triton's vLLM-backend I/O in front of the engine instances.

Each request is handled on a worker thread (decoupled BLS blocks while it streams): it is
validated, tokenized, routed by the global scheduler's policy, forwarded to the chosen
engine, and its tokens are detokenized incrementally and streamed back. Engine reports
on final responses keep the policy's view of every engine's cache and load current.
"""

from __future__ import annotations

import json
import threading
import time
import traceback
import uuid
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import triton_python_backend_utils as pb_utils

from preble_backend.detokenizer import IncrementalDetokenizer
from preble_backend.engine_client import EngineClient, EngineError, LocalEngine, make_engine_clients
from preble_backend.protocol import BadRequest, GenerateRequest, decode_report, parse_generate
from preble_backend.triton_common import (
    Metrics,
    config_parameters,
    read_inputs,
    require_decoupled,
    resolve_model_path,
    send_error,
    string_tensor,
)
from scheduler.cost_model import CostModel
from scheduler.nvml_load import LoadView
from scheduler.policy import FinishInfo, InstanceLoad, RoutingRequest, make_policy

INPUTS = (
    "text_input",
    "stream",
    "sampling_parameters",
    "exclude_input_in_output",
    "return_finish_reason",
    "return_num_input_tokens",
    "return_num_output_tokens",
)
DEFAULTS = {"model_path": "tiny", "engines": "preble_engine_0,preble_engine_1", "policy": "e2",
            "cost_model": "tiny_cpu", "max_inflight": "1024", "page_size": "16"}  # fmt: skip
LATENCY_BUCKETS = [0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120]


class TritonPythonModel:
    def initialize(self, args: dict) -> None:
        from transformers import AutoTokenizer

        self.model_config = json.loads(args["model_config"])
        require_decoupled(self.model_config)
        params = {**DEFAULTS, **config_parameters(self.model_config)}
        unknown = sorted(set(params) - set(DEFAULTS))
        if unknown:
            raise ValueError(f"unknown router parameter(s): {', '.join(unknown)}")
        model_path = resolve_model_path(params["model_path"], args["model_repository"])
        self.tokenizer = AutoTokenizer.from_pretrained(model_path)
        self.engines: list[EngineClient] = make_engine_clients(params["engines"])
        cost = CostModel.load(params["cost_model"]) if params["policy"] == "e2" else None
        self.page_size = _positive_int(params, "page_size")
        self.policy = make_policy(
            params["policy"], len(self.engines), cost_model=cost, page_size=self.page_size
        )
        self.load_view = LoadView([None] * len(self.engines))  # GPUs learnt from engine reports
        self.load_view.start()
        workers = _positive_int(params, "max_inflight")
        self.loads = [InstanceLoad() for _ in self.engines]
        self.lock = threading.Lock()
        self.pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="preble-route")
        self.metrics = Metrics({"model": args["model_name"]})
        pb_utils.Logger.log_info(
            f"preble router: policy {self.policy.name} over {[e.name for e in self.engines]}"
        )

    def execute(self, requests):
        for request in requests:
            self.pool.submit(self._handle, request, request.get_response_sender(), time.monotonic())
        return None

    def _handle(self, request, sender, arrival: float) -> None:
        try:
            req = parse_generate(read_inputs(request, INPUTS), request.parameters())
            ids = self.tokenizer(req.prompt).input_ids
            if not ids:
                raise BadRequest("input 'text_input' encodes to no tokens")
            routing = RoutingRequest(uuid.uuid4().hex, ids, req.params)
            routing.chain(self.page_size)  # hashed once, outside the policy's lock
            with self.lock:
                decision = self.policy.select(routing, self.loads)
                self.loads[decision.instance].in_flight += 1
            engine = self.engines[decision.instance]
            labels = {"policy": self.policy.name, "branch": decision.branch, "instance": engine.name}
            self.metrics.count("preble_router_decisions_total", "routing decisions", 1, labels)
            finished = False
            try:
                finished = self._forward(req, routing, decision.instance, sender)
            finally:
                with self.lock:
                    self.loads[decision.instance].in_flight -= 1
                    if not finished:  # the engine refused or failed it: forget the placement
                        self.policy.on_finish(decision.instance, routing, FinishInfo())
            self.metrics.observe("preble_router_request_latency_seconds", "request latency at the router",
                                 time.monotonic() - arrival, LATENCY_BUCKETS)  # fmt: skip
        except (BadRequest, ValueError, EngineError) as exc:
            send_error(sender, str(exc), pb_utils.TritonError.INVALID_ARG)
        except Exception as exc:
            pb_utils.Logger.log_error(f"preble router: {traceback.format_exc()}")
            send_error(sender, f"internal error: {exc}")

    def _forward(self, req: GenerateRequest, routing: RoutingRequest, instance: int, sender) -> bool:
        """Stream the engine's answer back; True once its final response was handled."""
        engine = self.engines[instance]
        detok = IncrementalDetokenizer(self.tokenizer, req.params.stop)
        num_output = sent_tokens = 0
        cancelled = finished = False
        start, ttft = time.monotonic(), None
        for resp in engine.generate(routing.request_id, routing.input_ids, req.params_json):
            if ttft is None and resp.token_ids:
                ttft = time.monotonic() - start
            if not cancelled and sender.is_cancelled():
                cancelled = True
                engine.abort(routing.request_id)  # keep reading: the final response confirms it
            num_output += len(resp.token_ids)
            delta = detok.add(resp.token_ids, final=resp.final)
            if resp.final:
                finished = True
                events, load = decode_report(resp.report) if resp.report else ([], {})
                self._learn_gpu(instance, engine, load)
                with self.lock:
                    self.load_view.report(instance, load)
                    self.loads[instance].reported = self.load_view.snapshot(instance)
                    self.policy.on_finish(instance, routing, FinishInfo(events, load, ttft, num_output))
            if cancelled:
                continue
            if req.stream and (delta or resp.final):
                self._send(sender, req, routing, engine, delta, num_output - sent_tokens, resp)
                sent_tokens = num_output
            elif resp.final:
                text = (req.prompt if req.prepend_input else "") + detok.text
                self._send(sender, req, routing, engine, text, num_output, resp)
        if cancelled:
            send_error(sender, "request was cancelled", pb_utils.TritonError.CANCELLED)
        return finished

    def _send(
        self, sender, req: GenerateRequest, routing: RoutingRequest, engine, text, n_tokens, resp
    ) -> None:
        tensors = [string_tensor("text_output", [text])]
        if req.return_num_output_tokens:
            tensors.append(pb_utils.Tensor("num_output_tokens", np.asarray([n_tokens], dtype=np.uint32)))
        flags = 0
        if resp.final:
            if req.return_finish_reason:
                tensors.append(string_tensor("finish_reason", [resp.finish_reason or ""]))
            if req.return_num_input_tokens:
                tensors.append(
                    pb_utils.Tensor("num_input_tokens", np.asarray([len(routing.input_ids)], dtype=np.uint32))
                )
            tensors.append(
                pb_utils.Tensor("num_cached_tokens", np.asarray([resp.num_cached_tokens], dtype=np.uint32))
            )
            tensors.append(string_tensor("instance", [engine.name]))
            flags = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
        sender.send(pb_utils.InferenceResponse(output_tensors=tensors), flags=flags)

    def _learn_gpu(self, instance: int, engine: EngineClient, load: dict) -> None:
        """A local engine on ``cuda:N`` gets its GPU sampled through NVML."""
        device = str(load.get("device", ""))
        if (
            isinstance(engine, LocalEngine)
            and device.startswith("cuda")
            and self.load_view.gpus[instance] is None
        ):
            self.load_view.gpus[instance] = int(device.partition(":")[2] or 0)
            self.load_view.start()

    def finalize(self) -> None:
        self.load_view.stop()
        self.pool.shutdown(wait=True, cancel_futures=False)


def _positive_int(params: dict[str, str], key: str) -> int:
    try:
        value = int(params[key])
        assert value >= 1
    except (ValueError, AssertionError):
        raise ValueError(f"{key}={params[key]!r} is invalid: expected an integer >= 1") from None
    return value
