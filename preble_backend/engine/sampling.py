"""The sampler: per-request random state and one token per request, as vLLM samples."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from preble_backend.common.sampling_params import SamplingParams


@dataclass
class SamplerState:
    """Per-request random state, so a seeded request samples the same tokens in any batch."""

    params: SamplingParams
    generator: torch.Generator | None = field(default=None)

    @classmethod
    def create(cls, params: SamplingParams, device) -> SamplerState:
        gen = None
        if not params.greedy:
            gen = torch.Generator(device=device)
            if params.seed is not None:
                gen.manual_seed(params.seed)
            else:
                gen.seed()
        return cls(params, gen)


def sample(logits: torch.Tensor, states: list[SamplerState], banned: list[list[int]]) -> list[int]:
    """One token per row; ``banned`` ids (EOS/stops before ``min_tokens``) get -inf."""
    return [sample_one(row, state, ban) for row, state, ban in zip(logits, states, banned)]


def sample_one(row: torch.Tensor, state: SamplerState, ban: list[int]) -> int:
    """One request's token: the engine samples each request on its own, so one that
    fails fails alone."""
    if ban:
        row = row.clone()
        row[ban] = float("-inf")
    p = state.params
    if p.greedy:
        return int(torch.argmax(row))
    row = row / p.temperature
    if p.top_k > 0 and p.top_k < row.shape[-1]:
        kth = torch.topk(row, p.top_k).values[-1]
        row = row.masked_fill(row < kth, float("-inf"))
    probs = torch.softmax(row, dim=-1)
    if p.top_p < 1.0:
        sorted_probs, order = torch.sort(probs, descending=True)
        keep = torch.cumsum(sorted_probs, dim=-1) - sorted_probs < p.top_p
        keep[0] = True
        mask = torch.zeros_like(probs, dtype=torch.bool).scatter(0, order[keep], True)
        probs = torch.where(mask, probs, torch.zeros_like(probs))
        probs = probs / probs.sum()
    return int(torch.multinomial(probs, 1, generator=state.generator))
