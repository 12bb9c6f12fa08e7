"""What an engine tells a router so E2 can price it before it has timed a pass (issue 63):
the model's shape and size, the device class and width (``ModelCard.cost_facts``), or,
for emulated compute, the fit it waits out."""

from __future__ import annotations

import torch

from preble_backend.common.pass_costs import PassCosts
from preble_backend.engine.config import EngineConfig
from preble_backend.model.model_card import device_class, model_card
from preble_backend.model.model_config import ModelConfig


def cost_facts(config: EngineConfig, device: torch.device, dtype: torch.dtype) -> dict:
    if config.compute == "emulated":
        return {"emulated": config.cost_model, "slowdown": config.emulated_slowdown}
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    dtype_name = str(dtype).removeprefix("torch.")
    card = model_card(config.model_path, config.model_path, dtype_name, device.type)
    return card.cost_facts(device_class(name), config.tensor_parallel_size, torch.get_num_threads())


def pass_costs(cfg: ModelConfig) -> PassCosts:
    """The engine's pass statistics, with its mixture's routing (the experts term)."""
    return PassCosts(*((cfg.moe.num_experts, cfg.moe.top_k) if cfg.moe else (0, 0)))
