"""``preble bench --simulate``: the bench's own requests through the simulated cluster.

The same prompts (tokenized as the router tokenizes them), arrival times and output
lengths as a live ``preble bench`` run, the same policies and rates (and the references
of ``reference.py`` beside them), and records with the same fields, so the simulator
and the live stack compare number for number. Against emulated engines (``--compute
emulated``) both sides run the same engine scheduler, radix cache and cost model: where
their numbers part, one of them is wrong — or the live host, not the modelled GPUs, is
the bottleneck.

With roles (``--prefill-engines``/``--decode-engines``, as ``preble repo`` writes them)
the policies that take roles pair engines as the live router does, and KV moves over a
``KVLink`` of the served model's KV bytes per token; the records then carry the TPOT of
requests decoding while a new document arrives, as the live bench's do.
"""

from __future__ import annotations

from client.bench import BenchConfig, build_trace, new_doc_fields, summary_line
from client.bench_config import Outcome
from preble_backend.common.cost_model import CostModel
from preble_backend.common.progress import progress
from preble_backend.model.model_card import model_card
from scheduler.disagg import KVLink
from scheduler.sim.reference import REFERENCES, over_reference
from scheduler.sim.simulator import SimConfig, SimRequest, SimResult
from scheduler.sim.sweep import at_rate, run

LINK_LATENCY_MS = 1.0  # the live router's per-transfer latency (``E2PD.link_latency_ms``)


def replay(cfg: BenchConfig, sim: SimConfig, cost: CostModel, log=print, roles: tuple[str, ...] = (),
           kv_gbps: float = 10.0, tpot_slo_ms: float = 0.0,
           ttft_slo_ms: float = 0.0) -> list[dict]:  # fmt: skip
    """One record per policy and rate (the simulator is deterministic: no repeats);
    ``tpot_slo_ms`` and ``ttft_slo_ms``: the router's settings of those names."""
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
    groups = [r.group for r in base]
    link = KVLink(kv_gbps, LINK_LATENCY_MS, kv_bytes_per_token(cfg.tokenizer, cost)) if roles else None
    records = []
    for rps in [None] if recorded else cfg.rates:
        requests = at_rate(timeline, 1.0, rps or 1.0)  # a recorded trace plays at its own times
        runs = [*cfg.policies, *REFERENCES]  # the references: what any router could do here
        for policy in progress(runs, desc=f"simulating @ {rps or 'trace'} rps", unit="policy"):
            metrics = run(requests, policy, sim, cost, link, lambda r: _pd_fields(r, groups),
                          {"tpot_slo_ms": tpot_slo_ms, "ttft_slo_ms": ttft_slo_ms}, roles)  # fmt: skip
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


def kv_bytes_per_token(model_dir: str, cost: CostModel) -> int:
    """What one token's KV takes as the engines' pools hold it (what they report as
    ``kv_bytes_per_token``): fp32 on a CPU, 16-bit on a GPU."""
    device = "cpu" if cost.device == "cpu" else "cuda"
    return model_card(model_dir, model_dir, device=device).kv_bytes_per_token


def _pd_fields(result: SimResult, groups: list[str]) -> dict:
    """The live bench's TPOT of requests decoding while a new document arrives, from the
    simulated requests' times, and the KV tokens moved between instances."""
    records = [result.records[f"r{i}"] for i in range(len(groups))]
    outcomes = [Outcome(r.arrival, r.first_token, r.finish, r.output_len,
                        error=None if r.finish is not None else "unfinished") for r in records]  # fmt: skip
    return {**new_doc_fields(outcomes, groups), "moved_tokens": result.moved_tokens}
