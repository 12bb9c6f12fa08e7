"""E2's online cost model in the simulator (issue 63): what a wrong fit costs, and how soon
E2 learns its engines' own costs.

Each scenario is a cluster's true costs, per instance, and the fit E2 starts from:

- ``mixed``: two fast and two slow instances, the slow ones 2x the fast ones' every
  cost (the paper's Mistral-7B-on-A6000 fit) and reporting a device of their own, as a
  slower GPU does (so no slow engine borrows a fast one's learnt fit, nor the reverse);
  E2 starts from the fast ones' fit;
- ``off10``: four equal instances; E2 starts from their fit with PREFILLTIME's per-token
  cost 10x too high, so recompute weighs 10x too much against load (a fit scaled as a
  whole changes no decision: L, M and P all scale with it);
- ``smollm2_from_tiny`` and ``tiny_from_smollm2``: engines whose true costs are SmolLM2's
  fit on this project's CPU while E2 starts from the embedded tiny model's, and the
  reverse (what ``preble repo`` configured before ``cost_model: auto``).

Policies: ``e2_true`` (E2 given each instance's true costs: what calibration aims at),
``e2_online`` (E2 calibrating from the prior, as ``cost_model: auto`` does),
``e2_prior`` (E2 fixed at the prior) and the baselines. Metrics are over the requests
after the first ``after`` to arrive (and over all of them, under ``all``). For
``e2_online`` the run also reports how often its choice matched the one the true costs
make on the same state (``Calibrated.shadow``), before and after ``after`` requests, and
from which request on it stays matched (``agree_from``: every later window of
``AGREE_WINDOW`` costed decisions agrees at ``AGREE_SHARE`` or more).

    python -m scheduler.sim.calibration_bench --out docs/sim --jobs 2

``--stress-from R`` runs R's cells at the rates and trace lengths R found (no search);
``--policies`` runs only those; ``--merge R`` writes R with the new runs in place of the
same cell's and policy's (E2 calibrating again after a change to it, say).
"""

from __future__ import annotations

import argparse
import gzip
import json
import multiprocessing
import statistics
from concurrent.futures import ProcessPoolExecutor
from dataclasses import replace
from pathlib import Path

from preble_backend.common.cost_model import CostModel
from preble_backend.common.progress import progress
from scheduler.cost_priors import TYPICAL_DECODE, with_decode_step
from scheduler.e2 import E2
from scheduler.policies import make_policy
from scheduler.sim.simulator import SimConfig, metrics, simulate
from scheduler.sim.sweep import _cached_trace, at_rate, cluster_facts, stress_or_why

WORKLOADS = ("toolbench", "embodied_agent", "programming", "videoqa", "loogle", "chat", "shifting_docs")
SCENARIOS = ("mixed", "off10", "smollm2_from_tiny", "tiny_from_smollm2")
BASELINES = ("round_robin", "least_load", "prefix_hash", "cache_aware", "kv_cost")
E2_VARIANTS = ("e2_true", "e2_online", "e2_prior")
AGREE_WINDOW, AGREE_SHARE = 50, 0.9
INSTANCES = 4


def scenario(name: str) -> tuple[list[CostModel], CostModel]:
    """(each instance's true costs, the fit E2 starts from). The true costs' DECODETIME
    step is their own iteration time at ``TYPICAL_DECODE``, as an online fit computes it: a
    shipped fit's is a measured median or a figure at another batch, and E2 given the
    truth would otherwise differ from E2 that has learnt it exactly."""
    truth, prior = _scenario(name)
    return [with_decode_step(t, *TYPICAL_DECODE) for t in truth], prior


def _scenario(name: str) -> tuple[list[CostModel], CostModel]:
    if name in ("mixed", "off10"):
        fast = CostModel.load("mistral7b_a6000")
        if name == "mixed":
            slow = replace(fast.scaled(2), device=f"{fast.device} at half speed")
            return [fast, fast, slow, slow], fast
        off = replace(fast, prefill_ms_per_token=10 * fast.prefill_ms_per_token, source="prefill x10")
        return [fast] * INSTANCES, off
    smollm2, tiny = CostModel.load("smollm2_cpu"), CostModel.load("tiny_cpu")
    if name == "smollm2_from_tiny":
        return [smollm2] * INSTANCES, tiny
    if name == "tiny_from_smollm2":
        return [tiny] * INSTANCES, smollm2
    raise ValueError(f"scenario={name!r} is invalid: expected one of {', '.join(SCENARIOS)}")


def _policy(name: str, truth: list[CostModel], prior: CostModel, cfg: SimConfig, clock):
    if name == "e2_true":
        return E2(INSTANCES, list(truth), cfg.capacity_tokens, clock=clock)
    if name == "e2_prior":
        return E2(INSTANCES, prior, cfg.capacity_tokens, clock=clock)
    if name == "e2_online":
        policy = E2(INSTANCES, prior, cfg.capacity_tokens, clock=clock, calibrate=True)
        policy.shadow = list(truth)
        return policy
    return make_policy(name, INSTANCES, cluster_facts(cfg, prior, clock))


def agree_from(agreement: list[tuple[int, bool]]) -> int | None:
    """The first decision from which every later window of ``AGREE_WINDOW`` costed decisions
    agrees at ``AGREE_SHARE`` or more (None: never)."""
    flags = [ok for _, ok in agreement]
    if len(flags) < AGREE_WINDOW:
        return None
    first = None
    for start in range(len(flags) - AGREE_WINDOW + 1):
        good = sum(flags[start : start + AGREE_WINDOW]) >= AGREE_SHARE * AGREE_WINDOW
        first = None if not good else (start if first is None else first)
    return None if first is None else agreement[first][0]


def _run(job: tuple) -> dict:
    workload, n, seed, rps, name, policy_name, after = job
    truth, prior = scenario(name)
    cfg = SimConfig.of(INSTANCES)
    made = []

    def factory(clock):
        made.append(_policy(policy_name, truth, prior, cfg, clock))
        return made[0]

    result = simulate(at_rate(_cached_trace(workload, n, seed), 1.0, rps), factory, cfg, truth)
    record = {**metrics(result, after), "all": metrics(result)}
    if policy_name == "e2_online":
        agreement = made[0].agreement
        early = [ok for i, ok in agreement if i < after]
        late = [ok for i, ok in agreement if i >= after]
        record["agreement_before"] = sum(early) / len(early) if early else None
        record["agreement_after"] = sum(late) / len(late) if late else None
        record["agree_from"] = agree_from(agreement)
        record["fits"] = [fit.summary() for fit in made[0].cost_fits()]
    return record


def stress_rate(job: tuple) -> tuple[float | None, int, str]:
    """Where round robin's p99 is 5x its light-load p99 (``sweep.find_stress_rps``), found on
    the first trace, and the requests a trace needs to get there (more than asked where so
    few cannot stress the cluster; None and why where no trace the bench grows can:
    ``sweep.stress_or_why``); a top-level function of ``(workload, scenario, requests)``
    for a pool."""
    workload, name, n = job
    truth, _ = scenario(name)
    return stress_or_why(workload, n, SimConfig.of(INSTANCES), truth)


def bench(workloads, scenarios, n: int, seeds: int, after: int, jobs: int, fractions=(0.5, 1.0),
          policies: tuple[str, ...] | None = None, known: dict | None = None) -> list[dict]:  # fmt: skip
    """``known``: (workload, scenario) -> (stress rate, requests) from an earlier record."""
    known = known or {}
    cells = [(workload, name, n) for name in scenarios for workload in workloads]
    search = [c for c in cells if c[:2] not in known]
    # Spawned, not forked: a fork of a process whose torch thread pool is running deadlocks.
    with ProcessPoolExecutor(jobs, mp_context=multiprocessing.get_context("spawn")) as pool:
        found = progress(pool.map(stress_rate, search), total=len(search), desc="stress rates", unit="cell")
        stress = dict(zip(search, found))
        stress.update({c: (*known[c[:2]], "") for c in cells if c[:2] in known})
        grid = []
        for workload, name, _ in cells:
            run = E2_VARIANTS + (BASELINES if name in ("mixed", "off10") else ("cache_aware",))
            rate, size, _ = stress[workload, name, n]
            if rate is None:
                continue
            for fraction in fractions:
                grid += [
                    (workload, size, seed, rate * fraction, name, p, after, fraction)
                    for p in run
                    if policies is None or p in policies
                    for seed in range(seeds)
                ]
        work = pool.map(_run, [g[:7] for g in grid])
        runs = list(progress(work, total=len(grid), desc="calibration", unit="run"))
    records: dict[tuple, dict] = {}
    for (workload, size, _, rps, name, policy, _, fraction), run in zip(grid, runs):
        key = (name, workload, fraction, policy)
        fresh = {"scenario": name, "workload": workload, "stress_fraction": fraction, "rps": rps,
                 "requests": size, "policy": policy, "per_seed": []}  # fmt: skip
        rec = records.setdefault(key, fresh)
        rec["per_seed"].append(run)
    for rec in records.values():
        for k in ("avg_latency_s", "p99_latency_s", "cache_hit_ratio"):
            rec[k] = statistics.fmean(r[k] for r in rec["per_seed"])
            rec[k + "_all"] = statistics.fmean(r["all"][k] for r in rec["per_seed"])
    skipped = [{"scenario": name, "workload": workload, "requests": size, "not_run": why}
               for (workload, name, _), (rate, size, why) in stress.items() if rate is None]  # fmt: skip
    return list(records.values()) + skipped


def stress_of(records: list[dict]) -> dict:
    """(workload, scenario) -> (stress rate, requests), as a record ran them."""
    return {(r["workload"], r["scenario"]): (r["rps"] / r["stress_fraction"], r["requests"])
            for r in records if "not_run" not in r}  # fmt: skip


def merge(earlier: list[dict], later: list[dict]) -> list[dict]:
    """``earlier`` with ``later``'s records in place of the same cell's and policy's, and
    its others added."""
    key = lambda r: (r["scenario"], r["workload"], r.get("stress_fraction"), r.get("policy"))  # noqa: E731
    new = {key(r): r for r in later}
    return [new.pop(key(r), r) for r in earlier] + list(new.values())


def summarize(records: list[dict]) -> list[str]:
    """Markdown: per scenario, workload and rate, E2 online and E2 at the prior over E2 given
    the true costs (average, p99, after the first requests), the best baseline's, and the
    decisions' agreement."""
    cells: dict[tuple, dict[str, dict]] = {}
    not_run = [f"{r['scenario']} {r['workload']} not run: {r['not_run']}" for r in records if "not_run" in r]
    for rec in (r for r in records if "not_run" not in r):
        cells.setdefault((rec["scenario"], rec["workload"], rec["stress_fraction"]), {})[rec["policy"]] = rec
    head = ("scenario", "workload", "load", "online/true avg", "online/true p99", "prior/true avg",
            "prior/true p99", "hit online / true / prior", "agreement after", "agree from",
            "behind a baseline")  # fmt: skip
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for (name, workload, fraction), by in sorted(cells.items()):
        true, online, prior = by["e2_true"], by["e2_online"], by["e2_prior"]
        agree = [r["agreement_after"] for r in online["per_seed"] if r["agreement_after"] is not None]
        starts = [r["agree_from"] for r in online["per_seed"]]
        hits = "/".join(f"{r['cache_hit_ratio']:.3f}" for r in (online, true, prior))
        lines.append(
            f"| {name} | {workload} | {fraction:g} | {online['avg_latency_s'] / true['avg_latency_s']:.3f} "
            f"| {online['p99_latency_s'] / true['p99_latency_s']:.3f} "
            f"| {prior['avg_latency_s'] / true['avg_latency_s']:.3f} "
            f"| {prior['p99_latency_s'] / true['p99_latency_s']:.3f} | {hits} "
            f"| {statistics.fmean(agree) if agree else float('nan'):.2f} | {starts} | {behind(online, by)} |"
        )
    return lines + not_run


def behind(online: dict, by: dict[str, dict]) -> str:
    """The baselines E2 online trails on average latency, each with its lead and whether the
    lead is within the traces' spread (the standard deviation of the per-trace differences)."""
    out = []
    for policy, rec in sorted(by.items()):
        if policy in E2_VARIANTS:
            continue
        diffs = [o["avg_latency_s"] - b["avg_latency_s"] for o, b in zip(online["per_seed"], rec["per_seed"])]
        lead = statistics.fmean(diffs)
        if lead > 0:
            spread = statistics.stdev(diffs) if len(diffs) > 1 else 0.0
            where = "within" if lead <= spread else "beyond"
            out.append(f"{policy} by {lead / rec['avg_latency_s']:.1%} ({where} spread)")
    return "; ".join(out) or "none"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workloads", default=",".join(WORKLOADS))
    p.add_argument("--scenarios", default=",".join(SCENARIOS))
    p.add_argument("--num-requests", type=int, default=600)
    p.add_argument("--seeds", type=int, default=5)
    p.add_argument("--after", type=int, default=200, help="metrics over the requests after these")
    p.add_argument("--jobs", type=int, default=2)
    p.add_argument("--policies", default="", help="only these (default: every one)")
    p.add_argument("--stress-from", default="", help="a record whose cells' rates and lengths to run at")
    p.add_argument("--merge", default="", help="a record to write again with these runs in it")
    p.add_argument("--out", default="", help="a directory for calibration.json.gz")
    args = p.parse_args()
    known = stress_of(_read(args.stress_from)) if args.stress_from else None
    policies = tuple(args.policies.split(",")) if args.policies else None
    records = bench(args.workloads.split(","), args.scenarios.split(","), args.num_requests, args.seeds,
                    args.after, args.jobs, policies=policies, known=known)  # fmt: skip
    if args.merge:
        records = merge(_read(args.merge), records)
    print("\n".join(summarize(records)))
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        with gzip.GzipFile(Path(args.out) / "calibration.json.gz", "wb", mtime=0) as f:
            f.write(json.dumps(records, indent=1).encode())


def _read(path: str) -> list[dict]:
    with gzip.open(path, "rt") as f:
        return json.load(f)


if __name__ == "__main__":
    main()
