"""``preble repo`` and ``preble serve`` say what E2 prices the engines with (issue 63): the
fit in use or the prior online calibration starts from, and a warning where that is
another model's or device's fit, never a silent default."""

from __future__ import annotations

import os
import sys

from preble_backend.model.model_card import ModelCard, device_class
from scheduler.cost_priors import describe


def engine_facts(card: ModelCard | None, device: str, tensor_parallel: int = 1, compute: str = "model",
                 fit: str = "", slowdown: float = 1.0) -> dict | None:  # fmt: skip
    """What the engines of ``card``'s model will report to the router
    (``ModelCard.cost_facts``); None where it is not known here (a GPU this machine cannot
    name). An emulated engine reports the fit it waits out, whatever its model."""
    if compute == "emulated" or card is None:  # an emulated repository needs no card
        return {"emulated": fit, "slowdown": slowdown}
    if device == "cpu":
        name = "cpu"
    else:
        import torch

        if not torch.cuda.is_available():
            return None
        name = torch.cuda.get_device_name(int(device.partition(":")[2] or 0))
    cores = len(os.sched_getaffinity(0)) if device == "cpu" else 0
    return card.cost_facts(device_class(name), tensor_parallel, cores)


def announce(setting: str, facts: dict | None, prefix: str) -> None:
    line, warning = describe(setting, facts)
    print(f"  cost     {line}")
    if warning:
        print(f"{prefix}: warning: {warning}", file=sys.stderr)
