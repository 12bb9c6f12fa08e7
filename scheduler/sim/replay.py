"""``preble bench --simulate``: the bench's own requests through the simulated cluster.

The same prompts (tokenized as the router tokenizes them), arrival times and output
lengths as a live ``preble bench`` run, the same policies and rates (and the references
of ``reference.py`` beside them), and records with the same fields, so the simulator
and the live stack compare number for number. Against emulated engines (``--compute
emulated``) both sides run the same engine scheduler, radix cache and cost model: where
their numbers part, one of them is wrong — or the live host, not the modelled GPUs, is
the bottleneck.
"""

from __future__ import annotations

from client.bench import BenchConfig, build_trace, summary_line
from preble_backend.common.cost_model import CostModel
from preble_backend.common.progress import progress
from scheduler.sim.reference import REFERENCES, over_reference
from scheduler.sim.simulator import SimConfig, SimRequest
from scheduler.sim.sweep import at_rate, run


def replay(cfg: BenchConfig, sim: SimConfig, cost: CostModel, log=print) -> list[dict]:
    """One record per policy and rate (the simulator is deterministic: no repeats)."""
    from transformers import AutoTokenizer

    if not cfg.tokenizer:
        raise ValueError("--simulate needs --tokenizer: the model whose tokenizer the router uses")
    tokenizer = AutoTokenizer.from_pretrained(cfg.tokenizer)
    base, recorded = build_trace(cfg)
    ids = [tokenizer(r.prompt).input_ids for r in progress(base, desc="tokenizing", unit="req")]
    timeline = [
        SimRequest(f"r{i}", r.arrival, ids[i], r.max_tokens, think_s=r.think_s,
                   after=None if r.after is None else f"r{r.after}")
        for i, r in enumerate(base)
    ]  # fmt: skip
    records = []
    for rps in [None] if recorded else cfg.rates:
        requests = at_rate(timeline, 1.0, rps or 1.0)  # a recorded trace plays at its own times
        runs = [*cfg.policies, *REFERENCES]  # the references: what any router could do here
        for policy in progress(runs, desc=f"simulating @ {rps or 'trace'} rps", unit="policy"):
            metrics = run(requests, policy, sim, cost)
            rec = {
                "policy": policy, "workload": cfg.trace or cfg.workload, "rps": rps, "repeat": 0,
                "completed": metrics["num_requests"], "errors": {}, **metrics,
                "prompt_tokens": sum(map(len, ids)),
            }  # fmt: skip
            records.append(rec)
    over_reference(records)
    over_reference(records, "p99_latency_s")
    for rec in records:
        log(summary_line(rec))
    return records
