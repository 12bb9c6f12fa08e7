"""Emulated compute: the engine's forward pass replaced by a wait from the cost model.

Everything else in the engine stays real — the local scheduler, the radix cache and its
LRU eviction, page accounting, cache events, streaming — so a host without a GPU can run
four or eight engines at GPU-scale timings behind the real router (NVIDIA Dynamo tests
its router the same way with its *mocker*). Each iteration waits
``cost.iteration_time(prefill tokens, decodes, context tokens)`` × ``slowdown`` and every
sampling request gets one placeholder token.

``slowdown`` exists for hosts too small to play a stress rate: every service time ×k with
arrivals ÷k is the same queueing system run k times slower, so a bench at ``rate / k``
against engines slowed ×k measures what ``rate`` would against the modelled GPUs
(latencies ×k), while the host's router and engine loops get k times longer per request.

The model directory is read for its configuration (vocabulary, context length,
end-of-sequence ids) and never for weights; the KV pool holds one number per token, so a
240k-token cache costs under a megabyte.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch

from preble_backend.common.cost_model import CostModel
from preble_backend.engine.scheduling.local_scheduler import ScheduledBatch
from preble_backend.model.kv_pool import KVPool
from preble_backend.model.model_config import ModelConfig


class EmulatedRunner:
    def __init__(self, model_path: str | Path, cost_model: str, slowdown: float = 1.0) -> None:
        self.device = torch.device("cpu")
        self.dtype = torch.float16
        self.cfg = ModelConfig.from_dir(model_path)
        self.cost = CostModel.load(cost_model)
        self.slowdown = slowdown
        self.placeholder = placeholder_token(self.cfg.vocab_size, self.cfg.eos_token_ids)
        self.iterations = 0
        self.emulated_s = 0.0  # modelled time, in total
        self.behind_s = 0.0  # how far the host's own work ran past the modelled times
        self._last_end: float | None = None  # the previous iteration's end; None after idling
        self.clock, self.sleep = time.monotonic, time.sleep  # a test drives its own

    def make_pool(self, num_pages: int, page_size: int, host: bool = False, window_pages: int = 0) -> KVPool:
        """Either tier's pool: one number per token (copies between tiers cost the cost
        model's ``load_ms_per_token`` in ``forward``); no window pool (its sliding layers
        are priced as full ones)."""
        return KVPool(num_pages, page_size, num_layers=1, num_kv_heads=1, head_dim=1, dtype=self.dtype)

    def kv_bytes_per_token(self) -> int:
        return 2 * self.dtype.itemsize

    def move_kv_slices(self, name: str, lanes: int, net_devices: str) -> None:
        """One rank: its pool is the whole KV (``ModelRunner.move_kv_slices``)."""

    def went_idle(self) -> None:
        """The engine ran out of work: its next iteration starts afresh."""
        self._last_end = None

    def close(self) -> None:
        """Nothing runs beside it."""

    def graph_replays(self) -> int:
        """No CUDA graphs here."""
        return 0

    def stats(self) -> dict[str, float]:
        """``emulated_behind_s`` > 0: the host could not keep up with the modelled device,
        and a bench on this engine measured the host too."""
        return {"emulated_iterations": self.iterations, "emulated_model_s": round(self.emulated_s, 3),
                "emulated_behind_s": round(self.behind_s, 3)}  # fmt: skip

    def forward(self, batch: ScheduledBatch, pool: KVPool) -> tuple[torch.Tensor, list[int]]:
        """Wait the iteration's modelled time; logits that make every sampler (greedy or
        not, penalties or not) pick the placeholder token.

        The modelled device runs the engine's iterations back to back: the host's work
        between two of them (sampling, streaming, scheduling) overlaps the next one, as in
        engines that schedule ahead (SGLang's overlap scheduler, vLLM's async scheduling),
        and only host work longer than an iteration shows. The simulator charges model
        time alone, so this is what lets the live stack and the simulator agree; without
        it every engine iteration also paid the Python engine loop's own time, which grows
        with the batch (a stressed round-robin ran 3x the simulator's latency)."""
        modelled = self.slowdown * self.cost.iteration_time(*batch.work()) / 1000.0
        now = self.clock()
        end = (now if self._last_end is None else self._last_end) + modelled
        if end > now:
            self.sleep(end - now)
        else:
            self.behind_s += now - end
        self._last_end = max(end, now)
        self.iterations += 1
        self.emulated_s += modelled
        rows = [i for i, (req, n) in enumerate(zip(batch.requests, batch.num_new_tokens))
                if req.num_computed + n == req.num_tokens]  # fmt: skip
        logits = torch.full((len(rows), self.cfg.vocab_size), -1e4)
        logits[:, self.placeholder] = 0.0
        return logits, rows


def placeholder_token(vocab_size: int, eos_ids) -> int:
    """A token from the middle of the vocabulary (an ordinary word piece in BPE
    vocabularies, whose special tokens sit at either end), never an end-of-sequence id."""
    token, eos = vocab_size // 2, set(eos_ids)
    while token in eos:
        token += 1
    return token
