"""The wire contracts, free of Triton imports so they can be tested on their own.

- The router ``preble`` speaks Triton's vLLM-backend contract (``text_input``, ``stream``,
  ``sampling_parameters``, ``exclude_input_in_output``, ``return_*``), plus
  ``num_cached_tokens`` and ``instance`` outputs.
- An engine ``preble_engine_<i>`` takes ``input_ids`` (INT32 [-1]), ``sampling_parameters``,
  ``request_id`` and ``events_since`` (the router's cursor in the engine's cache event
  log), and streams ``token_ids``; its final response adds ``finish_reason``,
  ``num_cached_tokens`` and a ``report``: its load snapshot and the cache events after
  the cursor (or a snapshot of its cache). A ``control`` input instead of a prompt asks
  for ``stats``, ``health``, ``abort`` of a request id, or ``flush_cache``; their reports
  carry the load only, so polling an engine takes no events from any router.
- Prefill/decode disaggregation rides on ``kv_transfer``: ``{"offer": true}`` makes a
  prefill leg's final report carry ``kv_offer`` (its prompt's pages, leased); ``{"take":
  <that offer>}`` makes a decode engine read what it lacks of them before it queues the
  request.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field

import numpy as np

from preble_backend.common.cache_event import CacheEvent, EventBatch
from preble_backend.common.fair_share import DEFAULT_TENANT
from preble_backend.common.sampling_params import SamplingParams
from preble_backend.common.settings import MAX_INPUT_BYTES
from preble_backend.common.tenants import (
    TENANT_PARAMETER,
    TPM_PARAMETER,
    WEIGHT_PARAMETER,
    check_tenant_name,
    check_weight,
)


@dataclass(frozen=True)
class TensorSpec:
    """One input or output of a model, as its ``config.pbtxt`` declares it."""

    name: str
    data_type: str  # Triton's TYPE_* name
    dims: tuple[int, ...]
    optional: bool = False


ROUTER_FLAGS = (
    "return_finish_reason",
    "return_cumulative_logprob",
    "return_logprobs",
    "return_num_input_tokens",
    "return_num_output_tokens",
)
ROUTER_INPUTS = (
    TensorSpec("text_input", "TYPE_STRING", (1,), optional=True),
    TensorSpec("stream", "TYPE_BOOL", (1,), optional=True),
    TensorSpec("sampling_parameters", "TYPE_STRING", (1,), optional=True),
    TensorSpec("exclude_input_in_output", "TYPE_BOOL", (1,), optional=True),
    *(TensorSpec(flag, "TYPE_BOOL", (1,), optional=True) for flag in ROUTER_FLAGS),
)
ROUTER_OUTPUTS = (
    TensorSpec("text_output", "TYPE_STRING", (-1,)),
    TensorSpec("finish_reason", "TYPE_STRING", (-1,)),
    TensorSpec("cumulative_logprob", "TYPE_FP32", (-1,)),
    TensorSpec("logprobs", "TYPE_STRING", (-1,)),
    TensorSpec("num_input_tokens", "TYPE_UINT32", (1,)),
    TensorSpec("num_output_tokens", "TYPE_UINT32", (-1,)),
    TensorSpec("num_cached_tokens", "TYPE_UINT32", (1,)),
    TensorSpec("instance", "TYPE_STRING", (1,)),
)
ENGINE_INPUTS = (
    TensorSpec("input_ids", "TYPE_INT32", (-1,), optional=True),
    TensorSpec("sampling_parameters", "TYPE_STRING", (1,), optional=True),
    TensorSpec("request_id", "TYPE_STRING", (1,), optional=True),
    TensorSpec("control", "TYPE_STRING", (1,), optional=True),
    TensorSpec("events_since", "TYPE_STRING", (1,), optional=True),
    TensorSpec("kv_transfer", "TYPE_STRING", (1,), optional=True),  # JSON: prefill/decode disaggregation
)
ENGINE_OUTPUTS = (
    TensorSpec("token_ids", "TYPE_INT32", (-1,)),
    TensorSpec("finish_reason", "TYPE_STRING", (1,)),
    TensorSpec("num_cached_tokens", "TYPE_INT32", (1,)),
    TensorSpec("report", "TYPE_STRING", (1,)),
    TensorSpec("logprobs", "TYPE_STRING", (1,)),  # JSON: per token, [[id, logprob, rank], ...]
)


def names(specs: tuple[TensorSpec, ...]) -> tuple[str, ...]:
    return tuple(spec.name for spec in specs)


CONTROL_OPS = ("stats", "health", "abort", "flush_cache")


class BadRequest(ValueError):
    """Input that can never be served; the message names the problem."""


# An engine's refusal of a request it can never serve (over the context, say) begins with
# this: gRPC stream errors carry no status code, and the router must answer the client
# "invalid" (HTTP 400), not "internal" (500), and not count the engine as failing.
REFUSED = "refused: "
FORBIDDEN = "admin control needs the admin key"  # the router's refusal; fronts answer it 403

# The router's error messages that mean "try again": at capacity, no engine up, the engine
# failed mid-request, shutting down. Fronts answer them 503 with Retry-After.
RETRYABLE = ("at capacity", "no engine is available", "failed while serving", "unreachable",
             "shutting down", "is unavailable")  # fmt: skip

# Triton's answers for a model that is not loaded, whose stub died, or whose server is
# stopping (an engine's server being restarted after its stub died): a restarted server
# gives them until its model is up. They are not the model refusing a request: the router
# moves a request on, and a front answers its client 503 (retry).
NOT_LOADED = ("Request for unknown model", "has no available versions", "is not ready", "is not healthy",
              "Server is stopping")  # fmt: skip


# A tenant over its tokens_per_minute: fronts answer 429 with Retry-After (the seconds named).
RATE_LIMITED = "tokens_per_minute="


def rate_limited(message: str) -> bool:
    return RATE_LIMITED in message


def retry_after(message: str) -> str:
    """The seconds a rate-limited refusal names ("retry in 12 s"), for ``Retry-After``."""
    found = re.search(r"retry in (\d+) s", message)
    return found.group(1) if found else "1"


def retryable(message: str) -> bool:
    return any(words in message for words in RETRYABLE) or not_loaded(message)


def not_loaded(message: str) -> bool:
    return any(words in message for words in NOT_LOADED)


# The router's and the engines' refusals of requests that can never be served as sent
# (a gRPC stream's error is text only): fronts answer them 400.
INVALID = ("is invalid", "must be", "input '", "encodes to no", "over the model's context length",
           "exceeds the KV pool", "outside the vocabulary", "is not valid JSON", "cannot be compiled",
           "both constrain", "need a tokenizer", "do not match the structured output", "over the limit",
           "took more than", "crashed the grammar compiler", "is refused for", "allows no")  # fmt: skip


def invalid(message: str) -> bool:
    return any(words in message for words in INVALID)


def _single(name: str, array: np.ndarray | None):
    if array is None:
        return None
    if array.size != 1:
        raise BadRequest(f"input '{name}' must hold exactly one element, got shape {list(array.shape)}")
    return array.reshape(-1)[0]


def _text(name: str, value) -> str:
    if isinstance(value, str):
        return value
    if not isinstance(value, bytes | np.bytes_):
        raise BadRequest(f"input '{name}' must be a string")
    try:
        return bytes(value).decode("utf-8")
    except UnicodeDecodeError as exc:
        raise BadRequest(f"input '{name}' is not valid UTF-8: {exc.reason} at byte {exc.start}") from None


def _flag(name: str, array: np.ndarray | None, default: bool = False) -> bool:
    value = _single(name, array)
    if value is None:
        return default
    if not isinstance(value, bool | np.bool_):
        raise BadRequest(f"input '{name}' must be a BOOL")
    return bool(value)


@dataclass(frozen=True)
class GenerateRequest:
    prompt: str
    params: SamplingParams
    params_json: str  # forwarded to the engine verbatim once validated
    stream: bool
    prepend_input: bool
    return_finish_reason: bool
    return_cumulative_logprob: bool
    return_logprobs: bool
    return_num_input_tokens: bool
    return_num_output_tokens: bool
    engine: str | None = None  # the request parameter ``preble_engine``: route there while it is up
    prefill_engine: str | None = None  # ``preble_prefill_engine``: prefill there first (disaggregated)
    tenant: dict[str, str] = field(default_factory=dict)  # ``preble_tenant`` and its weight (tenants.py)

    @property
    def tenant_name(self) -> str:
        return self.tenant.get(TENANT_PARAMETER, DEFAULT_TENANT)

    @property
    def tenant_weight(self) -> float | None:
        return float(self.tenant[WEIGHT_PARAMETER]) if WEIGHT_PARAMETER in self.tenant else None

    @property
    def tokens_per_minute(self) -> int:
        """The tenant's cap on the tokens one router serves it a minute (0: none)."""
        return int(self.tenant.get(TPM_PARAMETER, 0))


def parse_generate(
    inputs: dict[str, np.ndarray | None],
    request_parameters: str | None,
    max_text_bytes: int = MAX_INPUT_BYTES,
) -> GenerateRequest:
    """Validate a router request the way the vLLM backend reads it; a prompt over
    ``max_text_bytes`` is refused before anyone tokenizes it.

    Sampling parameters come from the ``sampling_parameters`` input, else from the
    request's own parameters (Triton's ``triton_*`` keys are not ours and are dropped;
    ``preble_engine`` names the engine to route to, ``preble_prefill_engine`` one to
    prefill on first).
    Without ``exclude_input_in_output`` a non-streaming answer repeats the prompt;
    streaming answers never do, and asking for it is an error.
    """
    raw = _single("text_input", inputs.get("text_input"))
    if raw is None:
        raise BadRequest("missing required input 'text_input'")
    if isinstance(raw, bytes | np.bytes_) and len(raw) > max_text_bytes:
        raise BadRequest(
            f"input 'text_input' is {len(raw)} bytes: more than the router's max_input_bytes={max_text_bytes}"
        )
    prompt = _text("text_input", raw)
    if not prompt:
        raise BadRequest("input 'text_input' is empty")
    stream = _flag("stream", inputs.get("stream"))
    exclude = inputs.get("exclude_input_in_output")
    prepend = not _flag("exclude_input_in_output", exclude) if exclude is not None else not stream
    if prepend and stream:
        raise BadRequest("when streaming, exclude_input_in_output = false is not allowed")
    try:
        extra = json.loads(request_parameters or "{}")
    except json.JSONDecodeError as exc:
        raise BadRequest(f"request parameters are not valid JSON: {exc}") from None
    except RecursionError:
        raise BadRequest("request parameters are not valid JSON: nested too deeply") from None
    if not isinstance(extra, dict):
        raise BadRequest("request parameters must be a JSON object")
    tenant = take_tenant(extra)
    engine, prefill_engine = extra.pop("preble_engine", None), extra.pop("preble_prefill_engine", None)
    for key, value in (("preble_engine", engine), ("preble_prefill_engine", prefill_engine)):
        if value is not None and not isinstance(value, str):
            raise BadRequest(f"request parameter {key} must be an engine's name")
    sp = _single("sampling_parameters", inputs.get("sampling_parameters"))
    if sp is not None:
        params_json = _text("sampling_parameters", sp)
        params = SamplingParams.from_json(params_json)
    else:
        extra = {k: v for k, v in extra.items() if not k.startswith("triton_")}
        params = SamplingParams.from_dict(extra)
        params_json = json.dumps(extra)
    flags = {name: _flag(name, inputs.get(name)) for name in ROUTER_FLAGS}
    if flags["return_cumulative_logprob"] and params.logprobs is None:  # the engine must compute them
        params_json = json.dumps({**json.loads(params_json or "{}"), "logprobs": 0})
    return GenerateRequest(prompt, params, params_json, stream, prepend, **flags, engine=engine,
                           prefill_engine=prefill_engine, tenant=tenant)  # fmt: skip


def take_tenant(parameters: dict) -> dict[str, str]:
    """The request parameters ``preble_tenant``, ``preble_tenant_weight`` and
    ``preble_tenant_tokens_per_minute``, taken out of ``parameters`` and checked (none: the
    default tenant's, as ``{}``)."""
    name, weight = parameters.pop(TENANT_PARAMETER, None), parameters.pop(WEIGHT_PARAMETER, None)
    tpm = parameters.pop(TPM_PARAMETER, None)
    if name is None:
        if weight is not None or tpm is not None:
            raise BadRequest(f"request parameters {WEIGHT_PARAMETER} and {TPM_PARAMETER} name no tenant "
                             f"({TENANT_PARAMETER})")  # fmt: skip
        return {}
    try:
        tenant = {TENANT_PARAMETER: check_tenant_name(name, f"request parameter {TENANT_PARAMETER}")}
        if weight is not None:
            tenant[WEIGHT_PARAMETER] = f"{check_weight(weight, f'request parameter {WEIGHT_PARAMETER}'):g}"
    except ValueError as exc:
        raise BadRequest(str(exc)) from None
    if tpm is not None:
        if not str(tpm).isdigit() or int(tpm) < 1:
            raise BadRequest(f"request parameter {TPM_PARAMETER} must be a whole number of at least 1")
        tenant[TPM_PARAMETER] = str(int(tpm))
    return tenant


@dataclass(frozen=True)
class EngineCall:
    """One request to an engine model: a prompt, or a control operation."""

    request_id: str
    input_ids: list[int] | None = None
    params: SamplingParams | None = None
    control: dict | None = None
    events_since: str | None = None  # the router's cursor in the engine's event log
    kv: dict | None = None  # {"offer": true} or {"take": offer}: see the module's docstring
    tenant: str = DEFAULT_TENANT  # whose share it is served from, and that tenant's weight
    tenant_weight: float = 1.0


def parse_engine_call(
    inputs: dict[str, np.ndarray | None], fallback_id: str, request_parameters: str | None = None
) -> EngineCall:
    control = _single("control", inputs.get("control"))
    if control is not None:
        try:
            op = json.loads(_text("control", control))
        except (json.JSONDecodeError, RecursionError) as exc:
            raise BadRequest(f"input 'control' is not valid JSON: {exc}") from None
        if inputs.get("input_ids") is not None:
            raise BadRequest("input 'control' cannot be sent together with 'input_ids'")
        if not isinstance(op, dict) or op.get("op") not in CONTROL_OPS:
            raise BadRequest(f"input 'control' must be an object with op in {CONTROL_OPS}")
        if op["op"] == "abort" and not isinstance(op.get("request_id"), str):
            raise BadRequest("control op 'abort' needs a string request_id")
        return EngineCall(request_id=fallback_id, control=op)
    ids = inputs.get("input_ids")
    if ids is None:
        raise BadRequest("missing input 'input_ids' (or a 'control' input)")
    if ids.dtype.kind not in "iu":
        raise BadRequest(f"input 'input_ids' must be INT32, got {ids.dtype}")
    rid = _single("request_id", inputs.get("request_id"))
    params_raw = _single("sampling_parameters", inputs.get("sampling_parameters"))
    params = SamplingParams.from_json(
        _text("sampling_parameters", params_raw) if params_raw is not None else None
    )
    since = _single("events_since", inputs.get("events_since"))
    try:
        tenant = take_tenant(json.loads(request_parameters or "{}"))
    except (json.JSONDecodeError, RecursionError, AttributeError):
        raise BadRequest("request parameters must be a JSON object") from None
    return EngineCall(
        tenant=tenant.get(TENANT_PARAMETER, DEFAULT_TENANT),
        tenant_weight=float(tenant.get(WEIGHT_PARAMETER, 1.0)),
        kv=_kv_transfer(inputs.get("kv_transfer")),
        request_id=_text("request_id", rid) if rid is not None else fallback_id,
        input_ids=[int(t) for t in ids.reshape(-1)],
        params=params,
        events_since=_text("events_since", since) if since is not None else None,
    )


OFFER_KEYS = {"lease", "pages", "stamps", "tokens", "peer"}  # a prefill engine's kv_offer


def _kv_transfer(array: np.ndarray | None) -> dict | None:
    raw = _single("kv_transfer", array)
    if raw is None:
        return None
    try:
        kv = json.loads(_text("kv_transfer", raw))
    except (json.JSONDecodeError, RecursionError) as exc:
        raise BadRequest(f"input 'kv_transfer' is not valid JSON: {exc}") from None
    take = kv.get("take") if isinstance(kv, dict) else None
    if kv == {"offer": True} or (isinstance(take, dict) and len(kv) == 1 and OFFER_KEYS <= set(take)):
        return kv
    raise BadRequest('input \'kv_transfer\' must be {"offer": true} or {"take": <an engine\'s kv_offer>}')


def encode_report(load: dict, batch: EventBatch | None = None, offer: dict | None = None) -> str:
    """An engine's load snapshot and, on a final response, the cache events after the
    router's cursor (``engine/cache/event_log.py``) and a prefill leg's ``kv_offer``, as
    compact JSON."""
    data: dict = {"load": load} if offer is None else {"load": load, "kv_offer": offer}
    if batch is not None:
        data["events"] = [[e.kind, e.start, e.hashes, *([e.tier] if e.tier != "device" else [])]
                          for e in batch.events]  # fmt: skip
        data["log"] = [batch.log_id, batch.first, batch.next, batch.snapshot]
    return json.dumps(data, separators=(",", ":"))


def report_offer(text: str) -> dict | None:
    """A prefill leg's offer of its prompt's KV, from its final report."""
    return json.loads(text).get("kv_offer") if text else None


def decode_report(text: str) -> tuple[EventBatch | None, dict]:
    data = json.loads(text)
    if "log" not in data:
        return None, data.get("load", {})
    events = [CacheEvent(kind, tuple(hashes), start, *tier) for kind, start, hashes, *tier in data["events"]]
    log_id, first, nxt, snapshot = data["log"]
    return EventBatch(log_id, first, nxt, events, snapshot), data.get("load", {})
