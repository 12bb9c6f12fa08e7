"""The sampler: per-request random state and one token per request, as vLLM samples."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from preble_backend.common.sampling_params import SamplingParams


@dataclass
class SamplerState:
    """Per-request random state, so a seeded request samples the same tokens in any batch."""

    params: SamplingParams
    generator: torch.Generator | None = field(default=None)
    prompt_tokens: torch.Tensor | None = None  # the prompt's distinct ids (repetition penalty)

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


TokenLogprobs = dict[int, tuple[float, int]]  # token id -> (log probability, rank: 1 = likeliest)


def token_logprobs(row: torch.Tensor, token: int, top: int) -> TokenLogprobs:
    """The sampled token's log probability and rank, and the ``top`` likeliest tokens',
    from the model's own distribution (before penalties, temperature and top-k/p: vLLM's
    default ``raw_logprobs``)."""
    logprobs = torch.log_softmax(row.float(), dim=-1)
    chosen = float(logprobs[token])
    out = {token: (chosen, int((logprobs > chosen).sum()) + 1)}
    if top:
        values, ids = torch.topk(logprobs, top)
        for rank, (value, i) in enumerate(zip(values.tolist(), ids.tolist()), start=1):
            if value == float("-inf"):  # masked out (structured output): not an alternative
                break
            out.setdefault(i, (value, rank))
    return out


def apply_penalties(
    row: torch.Tensor, state: SamplerState, prompt_ids: Sequence[int], output_ids: Sequence[int]
) -> torch.Tensor:
    """vLLM's penalties, in its order: ``repetition_penalty`` on every token of the prompt
    and the output (a positive logit divided by it, a negative one multiplied), then
    ``frequency_penalty`` × each output token's count and ``presence_penalty`` once per
    output token present, subtracted."""
    p = state.params
    row = row.clone()
    if p.repetition_penalty != 1.0:
        if state.prompt_tokens is None:
            state.prompt_tokens = torch.tensor(sorted(set(prompt_ids)), dtype=torch.long, device=row.device)
        seen = torch.cat([state.prompt_tokens, torch.tensor(output_ids, dtype=torch.long, device=row.device)])
        seen = torch.unique(seen)
        logits = row[seen]
        row[seen] = torch.where(logits > 0, logits / p.repetition_penalty, logits * p.repetition_penalty)
    if output_ids and (p.frequency_penalty or p.presence_penalty):
        generated = torch.tensor(output_ids, dtype=torch.long, device=row.device)
        ids, counts = torch.unique(generated, return_counts=True)
        row[ids] -= p.frequency_penalty * counts.to(row.dtype) + p.presence_penalty
    return row


def sample(logits: torch.Tensor, states: list[SamplerState], banned: list[list[int]]) -> list[int]:
    """One token per row; ``banned`` ids (EOS/stops before ``min_tokens``) get -inf."""
    return [sample_one(row, state, ban) for row, state, ban in zip(logits, states, banned)]


def sample_one(
    row: torch.Tensor,
    state: SamplerState,
    ban: list[int],
    prompt_ids: Sequence[int] = (),
    output_ids: Sequence[int] = (),
) -> int:
    """One request's token: the engine samples each request on its own, so one that
    fails fails alone. ``prompt_ids`` and ``output_ids`` feed the penalties."""
    if state.params.penalized:
        row = apply_penalties(row, state, prompt_ids, output_ids)
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
