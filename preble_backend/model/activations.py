"""The MLP activations ``config.json`` may name (``hidden_act``; Gemma's
``hidden_activation``), shared by the dense MLP and the experts."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": F.silu,
    "gelu": F.gelu,
    "relu": F.relu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
}


def activation(name: str) -> Callable[[torch.Tensor], torch.Tensor]:
    """``name``'s function; refused, naming those supported, where there is none."""
    if name not in ACTIVATIONS:
        raise ValueError(f"hidden_act {name!r} is not supported: {list(ACTIVATIONS)}")
    return ACTIVATIONS[name]
