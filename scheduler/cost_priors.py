"""Where E2's cost model for an engine starts (issue 63): the shipped fit measured or
modelled for the engine's model on its device class, else an estimate from the model's
shape and the device's published figures. ``cost_model`` settings:

- ``auto`` (the default): per engine, the best prior, calibrated online as it serves;
- ``auto:NAME``: calibrated online from the fit ``NAME`` (a shipped name or a JSON path);
- ``NAME``: that fit, fixed, for every engine (reproducible experiments).

A prior is one of ``matches`` (a fit of this model on this device class and width),
``estimate`` (modelled here from the shape) or ``mismatch`` (a fit of another model or
device: E2 then prices this engine with another's timings until calibration takes over;
the router warns at start and exports it while it lasts).
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass, replace

from preble_backend.common.cost_model import SHIPPED, CostModel

AUTO = "auto"
TYPICAL_DECODE = (16, 512)  # batch, context: the DECODETIME step, as ``preble profile`` times it
# Device class -> (memory bandwidth B/s, effective dense bf16 FLOP/s, host link B/s). Effective
# compute is half the data sheet's dense peak, as the shipped fits assume (H100 SXM: 989 TFLOPS
# dense bf16, 3.35 TB/s HBM3; H200: 4.8 TB/s HBM3e; A100 SXM 80GB: 312 TFLOPS, 2.04 TB/s;
# RTX A6000: 155 TFLOPS tensor, 768 GB/s; L40S: 362 TFLOPS, 864 GB/s; B200: 2.25 PFLOPS, 8 TB/s).
# Host links: PCIe 5.0 x16 ~50 GB/s pinned, PCIe 4.0 x16 ~25 GB/s.
GPUS = {
    "H100": (3.35e12, 5.0e14, 50e9),
    "H200": (4.8e12, 5.0e14, 50e9),
    "B200": (8.0e12, 1.1e15, 50e9),
    "A100": (2.04e12, 1.56e14, 25e9),
    "A6000": (7.68e11, 7.8e13, 25e9),
    "L40S": (8.64e11, 1.8e14, 25e9),
}
# A CPU engine, per core of its own: fp32 matmuls at ~50 GFLOP/s (AVX-512 FMA at ~3 GHz, about
# a third of peak), ~5 GB/s of memory bandwidth, and copies between KV pools at ~2 GB/s.
CPU_CORE = (5e9, 5e10, 2e9)
GPU_LAUNCH_MS_PER_LAYER = 0.05  # an eager pass's kernel launches, ~10 per layer at ~5 us
ALL_REDUCE_MS = 0.012  # one all-reduce over NVLink, two per layer at tensor parallelism > 1


@dataclass(frozen=True)
class Prior:
    model: CostModel
    label: str  # what it is, in words
    kind: str  # matches | estimate | mismatch


def parse_setting(text: str) -> tuple[bool, str | None]:
    """(calibrate online, the fit named, if any)."""
    if text == AUTO:
        return True, None
    if text.startswith(AUTO + ":"):
        return True, text[len(AUTO) + 1 :]
    return False, text


def check_setting(text: str) -> None:
    """Refuse a setting whose fit does not load, at configuration time."""
    named = parse_setting(text)[1]
    if named is not None:
        CostModel.load(named)


@functools.cache
def shipped() -> dict[str, CostModel]:
    """The shipped fits by name, read once (a router asks once per engine that joins)."""
    return {p.stem: CostModel.load(p) for p in sorted(SHIPPED.glob("*.json"))}


def prior_for(facts: dict, named: str | None = None) -> Prior:
    """The prior for an engine that reported ``facts`` (``ModelCard.cost_facts``, or an
    emulated engine's fit and slowdown)."""
    if "emulated" in facts:  # the engine waits out this very model: it is its own truth
        fit = CostModel.load(facts["emulated"]).scaled(float(facts.get("slowdown", 1.0)))
        if named is None or named == facts["emulated"]:  # named: as slowed down as the engine waits it out
            return Prior(fit, f"the emulated engine's own fit {facts['emulated']}", "matches")
        facts = {"model": fit.model, "device": fit.device, "tensor_parallel": fit.tensor_parallel}
    if named is not None:
        fit = CostModel.load(named)
        kind = "matches" if matches(fit, facts) else "mismatch"
        return Prior(fit, f"{named} ({_what(fit)})", kind)
    for name, fit in shipped().items():
        if matches(fit, facts):
            return Prior(fit, f"shipped fit {name} ({_what(fit)})", "matches")
    return Prior(estimate(facts), f"first-principles estimate for {_what_engine(facts)}", "estimate")


def mismatch_message(prior: Prior, facts: dict, fixed: bool = False) -> str:
    until = ("and never learns better: cost_model auto learns each engine's own costs" if fixed
             else "until the online fit takes over")  # fmt: skip
    return f"E2 prices {_what_engine(facts)} with {prior.label}, another model's or device's timings, {until}"


def matches(fit: CostModel, facts: dict) -> bool:
    return bool(fit.model) and (fit.model, fit.device, fit.tensor_parallel) == (
        facts.get("model"), facts.get("device"), int(facts.get("tensor_parallel", 1)))  # fmt: skip


def _what(fit: CostModel) -> str:
    return f"{fit.model or 'an unnamed model'} on {fit.device or 'an unnamed device'}" + (
        f" at TP {fit.tensor_parallel}" if fit.tensor_parallel > 1 else "")  # fmt: skip


def _what_engine(facts: dict) -> str:
    tp = int(facts.get("tensor_parallel", 1))
    return f"{facts.get('model', '?')} on {facts.get('device', '?')}" + (f" at TP {tp}" if tp > 1 else "")


def estimate(facts: dict) -> CostModel:
    """PREFILLTIME and DECODETIME from the model's shape and the device's figures, as the
    shipped GPU fits were derived: the base is the weights every pass streams (the
    experts apart: ``experts_ms``, charged by the share a batch reads), a token costs two
    FLOPs per active parameter, a context token its KV's bytes, each rank holding
    ``1 / tp`` of all three. A device class not in the table is priced as an H100. Within a
    few times of a measurement (docs/SCHEDULER.md shows how far), which is all a prior
    needs: the online fit replaces it."""
    device, tp = facts.get("device", "cpu"), max(1, int(facts.get("tensor_parallel", 1)))
    item = int(facts.get("dtype_bytes", 2))
    if device == "cpu":
        cores = max(1, int(facts.get("cores") or 1))
        bandwidth, flops, link = (v * cores for v in CPU_CORE)
        overhead = 0.0
    else:
        bandwidth, flops, link = GPUS.get(device, GPUS["H100"])
        layers = int(m.group(1)) if (m := re.search(r"\bL(\d+)\b", str(facts.get("model", "")))) else 32
        overhead = layers * (GPU_LAUNCH_MS_PER_LAYER + (2 * ALL_REDUCE_MS if tp > 1 else 0.0))
    params, experts = int(facts.get("parameters", 0)), int(facts.get("expert_parameters", 0))
    active = int(facts.get("active_parameters") or params)
    ms = 1000.0
    per_token = 2 * active / tp / flops * ms
    fit = CostModel(
        base_ms=(params - experts) * item / tp / bandwidth * ms + overhead,
        prefill_ms_per_token=per_token,
        decode_ms_per_request=per_token,
        attention_ms_per_context_token=int(facts.get("kv_bytes_per_token", 0)) / tp / bandwidth * ms,
        decode_step_ms=0.0,
        source=f"first-principles estimate for {_what_engine(facts)} (scheduler/cost_priors.py). Modelled, "
        "not measured",
        load_ms_per_token=int(facts.get("kv_bytes_per_token", 0)) / tp / link * ms,
        experts_ms=experts * item / tp / bandwidth * ms,
        num_experts=int(facts.get("num_experts", 0)),
        experts_per_token=int(facts.get("experts_per_token", 0)),
        model=str(facts.get("model", "")),
        device=str(device),
        tensor_parallel=tp,
    )
    return with_decode_step(fit, *TYPICAL_DECODE)


def with_decode_step(fit: CostModel, batch: float, context: float) -> CostModel:
    """DECODETIME's step: one decode iteration of ``batch`` requests over ``context`` tokens each."""
    step = fit.iteration_time(0, round(batch), round(batch * context))
    return replace(fit, decode_step_ms=step)


def describe(setting: str, facts: dict | None) -> tuple[str, str | None]:
    """What E2 prices the engines with under ``setting`` for engines that would report
    ``facts`` (None: not known before they start, a GPU's class), in one line, and a
    warning where that is another model's or device's fit (``preble repo``, ``preble serve``)."""
    calibrate, named = parse_setting(setting)
    if facts is None:
        start = f"from {named}" if named else "from a shipped fit that matches each engine, else an estimate"
        return (f"{setting}: learnt online per engine, {start}" if calibrate else f"{setting}: fixed"), None
    prior = prior_for(facts, named)
    if calibrate:
        line = f"{setting}: each engine's costs learnt online as it serves, from {prior.label}"
    else:
        line = f"{setting}: fixed, never learnt: {prior.label}"
    return line, mismatch_message(prior, facts, not calibrate) if prior.kind == "mismatch" else None
