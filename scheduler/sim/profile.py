"""``preble profile``: measure an engine's iteration times and fit the cost model.

Prefill iterations of 32–2048 tokens and decode iterations of 1–32 requests over 128–1024
tokens of context are timed on the real engine (prefix cache off, so every token is
computed), each ``repeats`` times; the median of each configuration is fitted by
non-negative least squares (``cost_model.fit``), and the fit's quality (R², relative
errors) is reported: timings on a shared or throttled CPU can be too noisy to fit, and
a poor fit is flagged rather than shipped silently.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import replace

import torch

from preble_backend.common.cost_model import CostModel, FitQuality, fit, fit_quality
from preble_backend.common.progress import progress
from preble_backend.engine.config import EngineConfig
from preble_backend.engine.engine import Engine

PREFILL_LENGTHS = (32, 64, 128, 256, 512, 1024, 2048)
DECODE_BATCHES = (1, 4, 16, 32)
DECODE_CONTEXTS = (128, 512, 1024)
TYPICAL_DECODE = (16, 512)  # batch, context of the DECODETIME step


def _timed_step(engine: Engine) -> float:
    if engine.runner.device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    engine.step()
    if engine.runner.device.type == "cuda":
        torch.cuda.synchronize()
    return (time.perf_counter() - start) * 1000.0


def profile(
    model_path: str, device: str = "cpu", repeats: int = 5, log=print
) -> tuple[CostModel, FitQuality]:
    engine = Engine(EngineConfig(model_path=model_path, device=device, chunk_size=4096,
                                 enable_prefix_caching=False, max_num_tokens=65536))  # fmt: skip
    vocab = engine.model_config.vocab_size
    gen = torch.Generator().manual_seed(0)
    samples: list[tuple[int, int, int, float]] = []
    ids = iter(range(10**9))

    def prompt(n: int) -> list[int]:
        return torch.randint(3, vocab, (n,), generator=gen).tolist()

    engine.generate([prompt(64)], {"max_tokens": 2})  # warm-up
    bar = progress(total=len(PREFILL_LENGTHS) + len(DECODE_BATCHES) * len(DECODE_CONTEXTS), unit="config",
                   desc="profiling")  # fmt: skip
    for n in PREFILL_LENGTHS:
        times = []
        for _ in range(repeats):
            engine.add_request(f"p{next(ids)}", prompt(n), {"max_tokens": 1, "ignore_eos": True})
            times.append(_timed_step(engine))
            while engine.has_work():
                engine.step()
        samples.append((n, 0, n, statistics.median(times)))
        bar.update()
        log(f"prefill {n:5d} tokens: {samples[-1][3]:8.2f} ms (median of {repeats})")
    step = 0.0
    for batch in DECODE_BATCHES:
        for context in DECODE_CONTEXTS:
            for _ in range(batch):
                engine.add_request(
                    f"d{next(ids)}", prompt(context), {"max_tokens": repeats + 24, "ignore_eos": True}
                )
            engine.step()
            sched = engine.scheduler
            while len(sched.waiting) or any(r.num_uncomputed > 1 for r in sched.running):
                engine.step()  # finish every prefill before timing decodes
            ms = statistics.median(_timed_step(engine) for _ in range(repeats))
            samples.append((0, batch, batch * context, ms))
            if (batch, context) == TYPICAL_DECODE:
                step = ms
            while engine.has_work():
                engine.step()
            bar.update()
            log(f"decode batch {batch:3d} context {context:5d}: {ms:8.2f} ms (median of {repeats})")
    bar.close()
    model = fit(samples, step, source=f"preble profile of {model_path} on {device}")
    # what it was measured for, as the engine tells a router: a fit without them is
    # "another model's or device's" wherever a repository names it (cost_priors.matches)
    facts = engine.cost_facts
    what = {key: facts[key] for key in ("model", "device", "tensor_parallel")}
    model = replace(model, **what)
    return model, fit_quality(samples, model)
