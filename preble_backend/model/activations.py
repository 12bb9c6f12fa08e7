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


def gated(name: str) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """A gated MLP's product of its gate and up projections: ``act(gate) * up``."""
    act = activation(name)
    return lambda gate, up: act(gate) * up


def clamped_swiglu(limit: float, alpha: float) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """gpt-oss's experts: the gate clamped above and up clamped both ways at ``limit``, then
    ``(up + 1) * gate * sigmoid(alpha * gate)``, op for op as transformers computes it."""

    def glu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        gate, up = gate.clamp(min=None, max=limit), up.clamp(min=-limit, max=limit)
        return (up + 1) * (gate * torch.sigmoid(gate * alpha))

    return glu
