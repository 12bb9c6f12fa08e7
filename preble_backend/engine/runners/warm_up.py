"""An engine's warm-up before its first request: its attention kernels compiled, and its
cache and counters left as they were."""

from __future__ import annotations

from preble_backend.engine.scheduling.local_scheduler import SchedulerStats


def warm_up(engine) -> None:
    """Run the attention paths once before the first request: on a GPU, Triton's kernels
    (and FlashInfer's) compile at first use, which put 1.8 s into the first request's
    time to first token on an H100 against 49 ms after. A prompt past the cascade
    threshold (any tokens: shapes matter), then two sharing it (cascade, chunks of
    several sizes, decodes); then the cache is flushed and the counters zeroed."""
    from preble_backend.model.attention_triton import CASCADE_MIN_SHARED_TOKENS as DEFAULT

    threshold = getattr(getattr(engine.runner, "backend", None), "min_shared_tokens", None) or DEFAULT
    length = min(threshold + engine.pool.page_size + 7, engine.model_config.max_context - 8,
                 engine.pool.capacity_tokens // 2 - 8)  # fmt: skip
    shared = [3 + (i * 7919) % (engine.model_config.vocab_size - 3) for i in range(length)]
    params = {"max_tokens": 3, "ignore_eos": True, "temperature": 0}
    engine.generate([shared], params)
    engine.generate([shared + [5], shared + [6, 7, 8]], params)
    engine.flush_cache()
    engine.scheduler.stats, engine.num_finished = SchedulerStats(), 0
