"""Replay of an Azure LLM inference trace (``TIMESTAMP, ContextTokens, GeneratedTokens``):
real arrivals and lengths, with synthesized shared prefixes, as ``WorkloadRequest``s."""

from __future__ import annotations

import csv
import random
from pathlib import Path

from client.workloads import Segment, WorkloadRequest, _zipf


def azure_trace(
    path: str | Path,
    shared_fraction: float = 0.5,
    num_prefixes: int = 50,
    seed: int = 0,
    limit: int | None = None,
) -> list[WorkloadRequest]:
    """Replay an Azure LLM inference trace (``TIMESTAMP, ContextTokens, GeneratedTokens``).
    The trace has no content, so each prompt gets a synthesized shared prefix (Zipf-1.1
    over ``num_prefixes``) covering ``shared_fraction`` of its context; arrivals keep the
    trace's timestamps, relative to the first."""
    import datetime as dt

    rng = random.Random(seed)
    out, start = [], None
    with open(path, newline="") as f:
        for i, row in enumerate(csv.DictReader(f)):
            if limit is not None and i >= limit:
                break
            stamp = row["TIMESTAMP"].strip()
            try:
                t = float(stamp)
            except ValueError:
                t = dt.datetime.fromisoformat(stamp[:26]).timestamp()
            start = t if start is None else start
            context, generated = int(row["ContextTokens"]), max(1, int(row["GeneratedTokens"]))
            prefix = _zipf(rng, num_prefixes, 1.1)
            shared = int(context * shared_fraction)
            segs = [
                Segment(f"az-prefix-{prefix}-{shared // 256}", shared),
                Segment(f"az-{seed}-{i}", context - shared),
            ]
            out.append(
                WorkloadRequest([s for s in segs if s.length > 0], generated, f"prefix-{prefix}", t - start)
            )
    return out
