"""How many KV pages an engine holds: its device pool and, for a model with sliding-window
layers, their window pool (``model/kv_pool.py``)."""

from __future__ import annotations

import torch

from preble_backend.engine.config import DEFAULT_CPU_KV_TOKENS, EngineConfig


def kv_pages(config: EngineConfig, runner) -> tuple[int, int]:
    """(device pool pages, window pool pages: 0 without sliding layers). ``max_num_tokens``
    0 on a GPU: what ``kv_memory_fraction`` of its free memory holds, the window pool
    taking its share (by default half a token of sliding layers per token of capacity)."""
    ps, tokens = config.page_size, config.max_num_tokens
    window = runner.cfg.sliding_window if config.compute == "model" else None
    if not tokens and runner.device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(runner.device)
        budget = int(free * config.kv_memory_fraction)
        if not window:
            tokens = budget // runner.kv_bytes_per_token()
        else:
            full, sliding = runner.kv_bytes_per_token(sliding=False), runner.kv_bytes_per_token(sliding=True)
            if config.window_kv_tokens and full:  # a fixed window pool: the rest is the full layers'
                tokens = (budget - config.window_kv_tokens * sliding) // full
            else:
                tokens = int(budget // (full + sliding / 2))
    elif not tokens:
        tokens = DEFAULT_CPU_KV_TOKENS
    pages = max(1, tokens // ps)
    return pages, config.window_pages(pages, window) if window else 0
