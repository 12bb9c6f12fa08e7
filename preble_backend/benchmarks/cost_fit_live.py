"""How close each engine's online fit came to ``preble profile``'s (issue 63): both predict
the iteration times of ``preble profile``'s own grid (prefills of 32-2048 tokens, decode
batches of 1-32 over 128-1024-token contexts, and DECODETIME's step), and the table gives
each engine's relative difference per configuration, their median and worst.

    preble bench ... --output runs/           # records each engine's fit after each run
    python -m preble_backend.benchmarks.cost_fit_live runs/bench.json profile.json
"""

from __future__ import annotations

import argparse
import json
import statistics
from dataclasses import fields
from pathlib import Path

from preble_backend.common.cost_model import CostModel
from scheduler.sim.profile import DECODE_BATCHES, DECODE_CONTEXTS, PREFILL_LENGTHS


def grid() -> list[tuple[str, tuple[int, int, int]]]:
    """``preble profile``'s configurations: (name, (prefill tokens, decodes, context))."""
    rows = [(f"prefill {n}", (n, 0, n)) for n in PREFILL_LENGTHS]
    rows += [(f"decode {b}x{c}", (0, b, b * c)) for b in DECODE_BATCHES for c in DECODE_CONTEXTS]
    return rows


def as_model(summary: dict) -> CostModel:
    """A fit as the router's admin status reports it (``CostFit.summary``)."""
    names = {f.name for f in fields(CostModel)}
    return CostModel(**{k: v for k, v in summary.items() if k in names})


def compare(learnt: CostModel, profiled: CostModel) -> dict:
    diffs = {name: learnt.iteration_time(*work) / profiled.iteration_time(*work) - 1 for name, work in grid()}
    diffs["decode step"] = learnt.decode_step_ms / profiled.decode_step_ms - 1
    spread = [abs(d) for d in diffs.values()]
    return {"per_config": diffs, "median_abs": statistics.median(spread), "max_abs": max(spread)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("bench", help="preble bench's JSON records (each run's cost_models)")
    p.add_argument("profile", help="preble profile's JSON fit of the same engines")
    args = p.parse_args()
    records = json.loads(Path(args.bench).read_text())["runs"]
    profiled = CostModel.load(args.profile)
    last = next(r for r in reversed(records) if r.get("cost_models"))
    for engine, summary in sorted(last["cost_models"].items()):
        result = compare(as_model(summary), profiled)
        print(f"{engine}: {summary['status']} over {summary['passes']:.0f} passes "
              f"(error {summary['error']}); against preble profile: median {result['median_abs']:.1%}, "
              f"worst {result['max_abs']:.1%}")  # fmt: skip
        for name, d in result["per_config"].items():
            print(f"  {name:18s} {d:+.1%}")


if __name__ == "__main__":
    main()
