"""The CPU attention path: the batch's decode queries attend in one SDPA call.

The reference (``kernels/reference.py``, backend ``torch``) loops over requests in Python,
gathers each one's K/V, repeats them for grouped-query attention and builds a mask per
request; at a decode batch of 8 that loop was a third of the engine's time. Here the
forward's plan (built by layer 0, reused by every layer) holds a slot matrix and a padding
mask per group of decode requests of similar context length (``decode_groups``); each
layer gathers a group's K/V in one indexing op and runs one SDPA call for it, grouped-query
attention by SDPA's ``enable_gqa`` (no repeated K/V).
Prefill and extend chunks go one request at a time, also in one SDPA call each: their
cost is the matmuls, not the loop. ``tests/test_kernels.py`` checks it against the reference.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from kernels.reference import context_slots, kv_write_ref
from preble_backend.model.attention import AttentionBackend, AttentionBatch


@dataclass
class DecodePlan:
    rows: torch.Tensor  # [Bd] the decode queries' rows in q
    slots: torch.Tensor  # [Bd, L] each one's K/V slots, positions 0..L-1 (padding: slot 0)
    mask: torch.Tensor  # [Bd, 1, 1, L] True where the position is the request's
    lens: torch.Tensor  # [Bd] each one's context length

    windowed: dict[int, torch.Tensor] = field(default_factory=dict)  # window_mask's, built once

    def window_mask(self, window: int) -> torch.Tensor:
        """``mask`` less each query's positions before its window (a sliding layer): built
        by the first sliding layer of the forward, reused by the others."""
        if window not in self.windowed:
            pos = torch.arange(self.mask.shape[-1], device=self.mask.device)
            self.windowed[window] = (
                self.mask & (pos[None, :] >= self.lens[:, None] - window)[:, None, None, :]
            )
        return self.windowed[window]

    @classmethod
    def build(cls, batch: AttentionBatch, members: list[int], starts: list[int], device) -> DecodePlan:
        lens = torch.tensor([batch.prefix_lens[b] + 1 for b in members], device=device)
        longest = int(lens.max())
        pos = torch.arange(longest, device=device)
        pages = batch.page_table[members].long().to(device)  # [Bd, max_pages]
        page_of = (pos // batch.page_size).clamp(max=pages.shape[1] - 1)
        slots = pages[:, page_of] * batch.page_size + pos % batch.page_size
        mask = pos[None, :] < lens[:, None]
        slots = torch.where(mask, slots, torch.zeros_like(slots))
        rows = torch.tensor([starts[b] for b in members], device=device)
        return cls(rows, slots, mask[:, None, None, :], lens)


@dataclass
class Plan:
    decode: list[DecodePlan]  # one per group of similar context lengths (``decode_groups``)
    extends: list[tuple[int, int, int, int]]  # (request, first row, q_len, prefix_len) of the others


class SdpaAttention(AttentionBackend):
    name = "sdpa"

    def forward(self, layer, q, k, v, batch, pool, window=None, scale=None, sinks=None):
        k_cache, v_cache = pool.k_cache[layer], pool.v_cache[layer]
        kv_write_ref(k_cache, v_cache, k, v, batch.slot_mapping)
        if not isinstance(batch.plan, Plan):
            batch.plan = self.plan(batch, q.device)
        plan, scale = batch.plan, scale or q.shape[-1] ** -0.5
        out = torch.empty_like(q)
        for d in plan.decode:
            keys = k_cache[d.slots].to(q.dtype).permute(0, 2, 1, 3)  # [Bd, Hkv, L, D]
            values = v_cache[d.slots].to(q.dtype).permute(0, 2, 1, 3)
            queries = q[d.rows].unsqueeze(2)  # [Bd, H, 1, D]
            mask = d.mask if window is None else d.window_mask(window)
            if sinks is not None:
                keys, values, mask = with_sink(keys, values, mask, sinks)
            attended = F.scaled_dot_product_attention(queries, keys, values, attn_mask=mask, scale=scale,
                                                      enable_gqa=True)  # fmt: skip
            out[d.rows] = attended.squeeze(2)
        for b, row, q_len, prefix in plan.extends:
            out[row : row + q_len] = self._extend(q[row : row + q_len], k_cache, v_cache, batch.page_table[b],
                                                  prefix, batch.page_size, scale, window, sinks)  # fmt: skip
        return out

    @staticmethod
    def _extend(queries, k_cache, v_cache, page_row, prefix: int, page_size: int, scale: float, window=None,
                sinks=None):  # fmt: skip
        """One request's chunk: its queries over its whole context (with a ``window``, from
        the first query's window on), causal."""
        n = queries.shape[0]
        first = 0 if window is None else max(0, prefix - window + 1)
        slots = context_slots(page_row, first, prefix + n, page_size)
        keys = k_cache[slots].to(queries.dtype).transpose(0, 1)  # [Hkv, L, D]
        values = v_cache[slots].to(queries.dtype).transpose(0, 1)
        q = queries.transpose(0, 1)  # [H, n, D]
        # A batch dimension: torch's CPU flash kernel takes 4-D inputs only; 3-D ones fall
        # to the math path, 4.3x slower for a 1,024-token causal prefill.
        q, keys, values = q[None], keys[None], values[None]
        if prefix == 0 and (window is None or window >= n) and sinks is None:
            mask, causal = None, True
        else:
            k_pos = torch.arange(first, prefix + n, device=queries.device)
            q_pos = torch.arange(prefix, prefix + n, device=queries.device)
            mask, causal = k_pos[None, :] <= q_pos[:, None], False
            if window is not None:
                mask &= k_pos[None, :] > q_pos[:, None] - window
            if sinks is not None:
                keys, values, mask = with_sink(keys, values, mask[None, None], sinks)
        out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, is_causal=causal, scale=scale,
                                             enable_gqa=True)  # fmt: skip
        return out[0].transpose(0, 1)

    @staticmethod
    def plan(batch: AttentionBatch, device) -> Plan:
        starts, row = [], 0
        for n in batch.q_lens:
            starts.append(row)
            row += n
        members = [b for b, n in enumerate(batch.q_lens) if n == 1]
        lens = [batch.prefix_lens[b] + 1 for b in members]
        decode = [DecodePlan.build(batch, [members[i] for i in group], starts, device)
                  for group in decode_groups(lens)]  # fmt: skip
        extends = [(b, starts[b], n, batch.prefix_lens[b]) for b, n in enumerate(batch.q_lens) if n != 1]
        return Plan(decode, extends)


def decode_groups(lens: list[int], spread: float = 2.0, least: int = 256) -> list[list[int]]:
    """The decode requests (their context lengths) split into groups, shortest first, each
    attending in one SDPA call: a group's requests are padded to its longest, so one call
    for a batch of 250- and 1,750-token contexts attended 8 x 1,750 positions where the
    requests have 3,500, and the pass cost more than eight 1,000-token ones (SmolLM2 on one
    core: 344-356 ms against 261-276). A group takes the next length while it is within
    ``spread`` times its shortest (or ``least`` tokens of it): at most ~half of what a group
    attends is padding, and a call per layer per group is cheap beside it."""
    order = sorted(range(len(lens)), key=lens.__getitem__)
    groups: list[list[int]] = []
    for i in order:
        if groups and lens[i] <= max(spread * lens[groups[-1][0]], lens[groups[-1][0]] + least):
            groups[-1].append(i)
        else:
            groups.append([i])
    return groups


def with_sink(keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, sinks: torch.Tensor):
    """Attention sinks (gpt-oss) in SDPA: a zero key and value after the others, which the
    mask scores with each head's ``sinks`` logit (a zero key scores 0): the sink joins the
    softmax and brings nothing. ``mask`` [B, 1, Lq, L] bool becomes [B, H, Lq, L + 1] float."""
    pad = keys.new_zeros(*keys.shape[:-2], 1, keys.shape[-1])
    keys, values = torch.cat([keys, pad], -2), torch.cat([values, pad], -2)
    heads = sinks.shape[0]
    bias = torch.zeros(mask.shape, dtype=keys.dtype, device=keys.device).masked_fill(~mask, float("-inf"))
    bias = bias.expand(bias.shape[0], heads, *bias.shape[2:])
    sink = sinks.to(keys.dtype).view(1, heads, 1, 1).expand(bias.shape[0], heads, bias.shape[2], 1)
    return keys, values, torch.cat([bias, sink], -1)
