"""Prefill/decode disaggregation in the simulator (issue 64): E2 pricing the choice per
request against aggregated E2 and the anchors' rules, on TTFT, TPOT and goodput.

Clusters (``CLUSTERS``), each on 8 GPUs of one node, KV moved over NVLink:

- ``70b_tp2``: Llama-3-70B, four TP-2 instances (the shipped H100 fit), P/D as 1 + 3;
- ``70b_tp4``: Llama-3-70B, two TP-4 instances, P/D as 1 + 1;
- ``8b``: Llama-3-8B, eight TP-1 instances (the first-principles H100 estimate), P/D as 2 + 6.

The link (``links``): NVLink 4 moves 450 GB/s per GPU each way (H100 and H200 SXM: 18
links × 25 GB/s; NVIDIA's "900 GB/s" counts both ways); a TP-k pair moves its k shards in
parallel, so k × 450. InfiniBand NDR (ConnectX-7, 400 Gb/s) is 50 GB/s per GPU's NIC, for
P and D on two nodes (``--link ib``). Each transfer also waits 0.5 ms (ours: NIXL's request
and its completion notice), and moves the KV bytes per token of the model (70B: 80 layers
× 8 KV heads × 128 × 2 × 2 bytes = 320 KiB; 8B: 32 layers, 128 KiB).

Policies: ``e2`` (aggregated, every instance ``both``), ``e2_pd`` (E2 choosing per request
with the P/D roles), ``e2_pd_slo`` (the same, told the TPOT SLO: no local prefill that would
push a decode instance past it, ``E2PD.tpot_slo_ms``), ``e2_pd_ttft`` (the same, told the
TTFT SLO instead: where only one of aggregated and the pair is expected to meet it, that
one, ``E2PD.ttft_slo_ms``), ``e2_pd_flex`` (every instance
``both``: E2 may pair any two), and with the P/D roles ``dynamo_pd``, ``dynamo_pd_load``
(its prefill-load variant: local while every prefill worker has 2 requests in flight),
``llmd_pd`` and ``sglang_pd``. Rates: the
stress rate (round robin's p99 at 5× its light-load p99, ``sweep.find_stress_rps``) and half
of it, on a trace doubled until that rate is a load and not a burst (up to ``--grow`` times
``--requests``; a cell that never gets there is reported as not run). SLOs for goodput:
``SLO``, per model.

    python -m scheduler.sim.disagg_bench --clusters 8b,70b_tp2 --seeds 3 --requests 300 --jobs 2

``--stress-from`` an earlier record runs its cells at the rates and trace lengths it found;
``--seeds 0`` only searches, and writes a record of those for a later run.
"""

from __future__ import annotations

import argparse
import gzip
import json
import multiprocessing
import statistics
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

from preble_backend.common.cost_model import CostModel
from preble_backend.common.progress import progress
from scheduler.cost_priors import TYPICAL_DECODE, estimate, with_decode_step
from scheduler.disagg import E2PD, KVLink
from scheduler.disagg_baselines import DynamoPD, LlmdPD, SGLangPD
from scheduler.e2 import E2
from scheduler.sim.simulator import SimConfig, metrics, simulate
from scheduler.sim.sweep import _cached_trace, at_rate, stress_or_why

WORKLOADS = ("toolbench", "embodied_agent", "programming", "videoqa", "loogle", "chat", "multi_tenant",
             "agentic", "shifting_docs")  # fmt: skip
POLICIES = ("e2", "e2_pd", "e2_pd_slo", "e2_pd_ttft", "e2_pd_flex", "dynamo_pd", "dynamo_pd_load", "llmd_pd",
            "sglang_pd")  # fmt: skip
OURS = ("e2_pd", "e2_pd_slo", "e2_pd_ttft", "e2_pd_flex")
KV_BYTES = {"70b": 80 * 8 * 128 * 2 * 2, "8b": 32 * 8 * 128 * 2 * 2}
GBPS_PER_GPU = {"nvlink": 450.0, "ib": 50.0}
LATENCY_MS = 0.5
SLO = {"70b": (2.0, 0.10), "8b": (1.0, 0.05)}  # (TTFT, TPOT) seconds
# name: (model, instances, tensor parallel, P/D roles)
CLUSTERS = {
    "70b_tp2": ("70b", 4, 2, ("prefill", "decode", "decode", "decode")),
    "70b_tp4": ("70b", 2, 4, ("prefill", "decode")),
    "8b": ("8b", 8, 1, ("prefill",) * 2 + ("decode",) * 6),
}


def cluster_cost(name: str) -> CostModel:
    model, _, tp, _ = CLUSTERS[name]
    if model == "70b":
        return CostModel.load(f"llama3_70b_h100_tp{tp}")
    facts = {"model": "llama L32 H4096 A32/8x128 I14336 V128256", "device": "H100", "tensor_parallel": 1,
             "parameters": 8_030_000_000, "kv_bytes_per_token": KV_BYTES["8b"]}  # fmt: skip
    return with_decode_step(estimate(facts), *TYPICAL_DECODE)


def link_for(name: str, kind: str) -> KVLink:
    model, _, tp, _ = CLUSTERS[name]
    return KVLink(GBPS_PER_GPU[kind] * tp, LATENCY_MS, KV_BYTES[model])


def make(policy: str, name: str, link: KVLink, cfg: SimConfig, clock):
    _, n, _, roles = CLUSTERS[name]
    cost = cluster_cost(name)
    e2 = dict(cost_model=cost, capacity_tokens=cfg.capacity_tokens, page_size=cfg.page_size, clock=clock)
    if policy == "e2":
        return E2(n, **e2)
    if policy in OURS:
        ttft_s, tpot_s = SLO[CLUSTERS[name][0]]
        slos = {"e2_pd_slo": {"tpot_slo_ms": 1000.0 * tpot_s}, "e2_pd_ttft": {"ttft_slo_ms": 1000.0 * ttft_s}}
        return E2PD(n, roles if policy != "e2_pd_flex" else ("both",) * n, link, **slos.get(policy, {}), **e2)
    kw = dict(page_size=cfg.page_size, clock=clock)
    if policy.startswith("dynamo_pd"):
        return DynamoPD(n, roles, prefill_queue=2 if policy == "dynamo_pd_load" else None, **kw)
    return {"llmd_pd": LlmdPD, "sglang_pd": SGLangPD}[policy](n, roles, **kw)


def _run(job: tuple) -> dict:
    name, link_kind, workload, n, seed, rps, policy = job
    cfg = SimConfig.of(CLUSTERS[name][1])
    link = link_for(name, link_kind)
    requests = at_rate(_cached_trace(workload, n, seed), 1.0, rps)
    result = simulate(
        requests, lambda clock: make(policy, name, link, cfg, clock), cfg, cluster_cost(name), link
    )
    branches: dict[str, int] = {}
    for r in result.records.values():
        branches[r.branch] = branches.get(r.branch, 0) + 1
    slo = SLO[CLUSTERS[name][0]]
    return {
        **metrics(result, slo=slo),
        "branches": branches,
        "moved_tokens": result.moved_tokens,
        "seed": seed,
    }


def stress_rate(job: tuple) -> tuple[float | None, int, str]:
    """(stress rps, requests, ""): more requests than asked where so few cannot stress the
    cluster; (None, requests, why) where no trace the bench grows can
    (``sweep.stress_or_why``)."""
    name, workload, n, grow = job
    return stress_or_why(workload, n, SimConfig.of(CLUSTERS[name][1]), cluster_cost(name), grow)


def stress_of(path: str | Path) -> dict[tuple[str, str], tuple[float | None, int, str]]:
    """The stress rates an earlier record ran at: (cluster, workload) -> what ``stress_rate``
    returns. The search is deterministic, so this is what it would find again, without its
    runs (16 of the 8B table's 44 minutes), and a change is compared at the same loads."""
    with gzip.open(path, "rt") as f:
        cells = json.load(f)["cells"]
    found = {}
    for c in cells:
        if "not_run" in c:
            found[c["cluster"], c["workload"]] = (None, c["requests"], c["not_run"])
        elif c["fraction"] == 1.0:
            found[c["cluster"], c["workload"]] = (c["rps"], c["requests"], "")
    return found


def merge(earlier: list[dict], later: list[dict]) -> list[dict]:
    """``later``'s traces after ``earlier``'s, cell by cell (the same cluster, workload and
    load), for more traces than one run could hold. Refused where a cell's rate differs or
    its policies do not match: traces at two loads, or one policy with more traces than the
    others, would be summarized as one."""
    key = lambda c: (c["cluster"], c["workload"], c.get("fraction"))  # noqa: E731
    added = {key(c): c for c in later if "policies" in c}
    out = []
    for c in earlier:
        new = added.pop(key(c), None)
        if new is None or "policies" not in c:
            out.append(c)
            continue
        if abs(new["rps"] - c["rps"]) > 1e-9 * c["rps"] or set(new["policies"]) != set(c["policies"]):
            raise ValueError(f"{key(c)}: {new['rps']} rps and {sorted(new['policies'])} cannot join the "
                             f"record's {c['rps']} rps and {sorted(c['policies'])}")  # fmt: skip
        policies = {p: runs + new["policies"][p] for p, runs in c["policies"].items()}
        out.append({**c, "policies": policies})
    return out + list(added.values())


def bench(clusters, link_kind: str, workloads, n: int, seeds: int, jobs: int, fractions=(0.5, 1.0),
          policies=POLICIES, grow: int = 8, known: dict | None = None,
          first_seed: int = 0) -> list[dict]:  # fmt: skip
    """``known``: stress rates already found (``stress_of``); the other cells are searched.
    Traces ``first_seed`` to ``first_seed + seeds - 1``."""
    known = known or {}
    cells = [(name, workload, n, grow) for name in clusters for workload in workloads]
    search = [c for c in cells if c[:2] not in known]
    with ProcessPoolExecutor(jobs, mp_context=multiprocessing.get_context("spawn")) as pool:
        searched = pool.map(stress_rate, search)
        found = dict(zip(search, progress(searched, total=len(search), desc="stress rates", unit="cell")))
        stress = {c: known[c[:2]] if c[:2] in known else found[c] for c in cells}
        traces = range(first_seed, first_seed + seeds)
        grid = [(name, link_kind, workload, size, seed, rate * f, policy, f)
                for (name, workload, _, _), (rate, size, _) in stress.items() if rate is not None
                for f in fractions for policy in policies for seed in traces]  # fmt: skip
        runs = list(progress(pool.map(_run, [g[:7] for g in grid]), total=len(grid), desc="runs", unit="run"))
    cells_out = {
        (name, workload, f): {"cluster": name, "link": link_kind, "workload": workload, "fraction": f,
                              "rps": rate * f, "requests": size, "policies": {}}
        for (name, workload, _, _), (rate, size, _) in stress.items() if rate is not None for f in fractions
    }  # fmt: skip
    for g, record in zip(grid, runs):  # (no seeds: the cells keep the rates found, for --stress-from)
        name, _, workload, _, _, _, policy, f = g
        cells_out[name, workload, f]["policies"].setdefault(policy, []).append(record)
    skipped = [{"cluster": name, "link": link_kind, "workload": workload, "requests": size, "not_run": why}
               for (name, workload, _, _), (rate, size, why) in stress.items() if rate is None]  # fmt: skip
    return list(cells_out.values()) + skipped


KEYS = ("avg_latency_s", "p99_latency_s", "avg_ttft_s", "p99_ttft_s", "avg_tpot_s", "p99_tpot_s", "goodput")


def summarize(cells: list[dict]) -> list[str]:
    """Per cell: each policy's mean over traces (and spread) of goodput and p99 TPOT, and
    E2 P/D against the best of the rest on both, and against aggregated E2 on average.
    The best p99 TPOT often belongs to a rule whose prompts queue for P (lower goodput), so
    each line also names the policies, `e2_pd_flex` among them, at least as good on both."""
    lines = []
    for c in cells:
        if "not_run" in c:
            lines.append(f"{c['cluster']:8s} {c['workload']:15s} not run: {c['not_run']}")
            continue
        mean = {
            p: {k: statistics.mean(r[k] for r in runs) for k in KEYS} for p, runs in c["policies"].items()
        }
        spread = {p: {k: (min(r[k] for r in runs), max(r[k] for r in runs)) for k in KEYS}
                  for p, runs in c["policies"].items()}  # fmt: skip
        others = [p for p in mean if p not in OURS]
        if not others or "e2" not in mean:
            lines.append(f"{c['cluster']:8s} {c['workload']:15s} x{c['fraction']:.1f}: no aggregated E2 "
                         "or rule ran beside ours (merge the record with one that has them)")  # fmt: skip
            continue
        best_good = max(others, key=lambda p: mean[p]["goodput"])
        best_tpot = min(others, key=lambda p: mean[p]["p99_tpot_s"])
        lines_for = ("e2_pd", "e2_pd_slo")
        for ours in (p for p in lines_for if p in mean):
            e = mean[ours]
            dominated = [p for p in mean if p not in lines_for and mean[p]["goodput"] >= e["goodput"]
                         and mean[p]["p99_tpot_s"] <= e["p99_tpot_s"]]  # fmt: skip
            lines.append(
                f"{c['cluster']:8s} {c['workload']:15s} x{c['fraction']:.1f} "
                f"goodput {ours} {e['goodput']:.3f} "
                f"{spread[ours]['goodput']} vs {best_good} {mean[best_good]['goodput']:.3f}; "
                f"p99 TPOT {ours} {e['p99_tpot_s'] * 1e3:.1f} ms "
                f"vs {best_tpot} {mean[best_tpot]['p99_tpot_s'] * 1e3:.1f} "
                f"(goodput {mean[best_tpot]['goodput']:.3f}); dominated by {','.join(dominated) or 'none'}; "
                f"avg latency {ours}/e2 {e['avg_latency_s'] / mean['e2']['avg_latency_s']:.3f}"
            )
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--clusters", default=",".join(CLUSTERS))
    ap.add_argument("--link", default="nvlink", choices=sorted(GBPS_PER_GPU))
    ap.add_argument("--workloads", default=",".join(WORKLOADS))
    ap.add_argument("--policies", default=",".join(POLICIES))
    ap.add_argument("--requests", type=int, default=300)
    ap.add_argument("--seeds", type=int, default=5)
    ap.add_argument("--first-seed", type=int, default=0, help="the first trace's seed")
    ap.add_argument("--merge", default=None,
                    help="an earlier record to add these traces to (run it with --stress-from that record "
                         "and --first-seed after its traces); the merged record is written")  # fmt: skip
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--grow", type=int, default=8, help="traces grow to at most this × --requests")
    ap.add_argument("--out", default=None, help="a directory for disagg.json.gz")
    ap.add_argument("--stress-from", default=None,
                    help="an earlier record (disagg_*.json.gz) whose cells' stress rates and trace lengths "
                         "to run at instead of searching for them again")  # fmt: skip
    args = ap.parse_args()
    known = stress_of(args.stress_from) if args.stress_from else None
    cells = bench(args.clusters.split(","), args.link, args.workloads.split(","), args.requests, args.seeds,
                  args.jobs, policies=args.policies.split(","), grow=args.grow, known=known,
                  first_seed=args.first_seed)  # fmt: skip
    if args.merge:
        with gzip.open(args.merge, "rt") as f:
            cells = merge(json.load(f)["cells"], cells)
    if args.out:  # before the summary: a run of ours alone (no rule to compare with) keeps its record
        path = Path(args.out) / f"disagg_{args.link}.json.gz"
        path.parent.mkdir(parents=True, exist_ok=True)
        with gzip.open(path, "wt") as f:
            json.dump({"args": vars(args), "cells": cells}, f)
        print(f"wrote {path}")
    for line in summarize(cells):
        print(line)


if __name__ == "__main__":
    main()
