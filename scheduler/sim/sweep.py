"""RPS sweeps in the simulator: every policy on the same trace, latency against load.

``find_stress_rps`` looks for the load the issue asks about: starting light, the request
rate grows by ×1.5 until round-robin's p99 latency is at least 5× its light-load p99.
``sweep`` then runs every policy at the light rate and at a quarter, half, three quarters
and all of the stress rate (evenly spaced, so a linear axis shows the knee), on the same
requests and arrival times (and on more traces with ``seeds``), and returns one
``simulator.metrics`` record per policy and rate.
"""

from __future__ import annotations

import functools
import gzip
import json
import multiprocessing
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from dataclasses import replace
from pathlib import Path

from client.plots import latency_vs_rate
from client.workloads import Materializer, WorkloadRequest, generate, poisson_arrivals
from preble_backend.common.cost_model import CostModel
from preble_backend.common.progress import progress
from scheduler.disagg import KVLink
from scheduler.policies import ALL_POLICIES, make_policy, policy_options
from scheduler.sim.reference import REFERENCES, over_reference, reference_metrics
from scheduler.sim.simulator import SimConfig, SimRequest, SimResult, metrics, simulate


def trace(workload: str, n: int, rps: float, seed: int = 0) -> list[SimRequest]:
    return sim_requests(workload, poisson_arrivals(generate(workload, n, seed=seed), rps, seed=seed))


def sim_requests(name: str, reqs: list[WorkloadRequest]) -> list[SimRequest]:
    """A workload's requests as the simulator takes them: token ids, the answers later
    prompts replay, and which request each follows."""
    words = Materializer()
    return [
        SimRequest(
            f"{name}-{i}", r.arrival, words.token_ids(r), r.output_len,
            output_ids=words.segment_ids(r.answer) if r.answer else None,
            after=None if r.after is None else f"{name}-{r.after}", think_s=r.think_s,
        )
        for i, r in enumerate(reqs)
    ]  # fmt: skip


def cluster_facts(cfg: SimConfig, cost: CostModel, clock) -> dict:
    """What a policy may know of the simulated cluster."""
    return {
        "clock": clock,
        "cost_model": cost,
        "capacity_tokens": cfg.capacity_tokens,
        "page_size": cfg.page_size,
    }


def run(requests: list[SimRequest], policy: str, cfg: SimConfig, cost: CostModel, link: KVLink | None = None,
        measure: Callable[[SimResult], dict] | None = None, facts: dict | None = None,
        roles: tuple[str, ...] = (), **options) -> dict:  # fmt: skip
    """One policy's run, or a reference's (``reference.py``), as one record's metrics;
    ``link`` and ``roles``: what moving KV costs and the instances' roles (told to a policy
    that pairs engines, as a live router learns them from the engines); ``measure``: more
    figures of the policy's run; ``facts``:
    cluster facts beyond the simulated cluster's own (an operator's setting, such as the
    router's ``tpot_slo_ms``)."""
    followers = [r for r in requests if r.after is not None]
    if policy in REFERENCES:  # one instance, or none: no turn ever moves
        return {**reference_metrics(policy, requests, cfg, cost), "follower_moves": 0,
                "followers": len(followers), "branches": {}, "per_engine": {}}  # fmt: skip
    takes = policy_options(policy)
    options.update({k: v for k, v in (("link", link), ("roles", roles)) if v and k in takes})

    def build(clock):
        known = {**cluster_facts(cfg, cost, clock), **(facts or {})}
        return make_policy(policy, cfg.num_instances, known, **options)

    result = simulate(requests, build, cfg, cost, link)
    branches: dict[str, int] = {}
    per_engine: dict[str, int] = {}
    for record in result.records.values():
        branches[record.branch] = branches.get(record.branch, 0) + 1
        per_engine[f"instance_{record.instance}"] = per_engine.get(f"instance_{record.instance}", 0) + 1
    records = result.records
    moved = sum(records[r.request_id].instance != records[r.after].instance for r in followers)
    return {**metrics(result), "follower_moves": moved, "followers": len(followers),
            "branches": branches, "per_engine": dict(sorted(per_engine.items())),
            **(measure(result) if measure else {})}  # fmt: skip


def at_rate(requests: list[SimRequest], base_rps: float, rps: float) -> list[SimRequest]:
    """The trace's timeline compressed to ``rps``: arrivals and think times alike (a turn
    still waits for its predecessor's answer)."""
    k = base_rps / rps
    return [replace(r, arrival=r.arrival * k, think_s=r.think_s * k) for r in requests]


def light_rate(requests: list[SimRequest], cost: CostModel, instances: int) -> float:
    """Where a stress search starts: ~5% of one instance's no-cache throughput per instance."""
    work = (cost.prefill_time(len(r.input_ids)) + cost.decode_time(r.output_len) for r in requests)
    return 0.05 * instances * 1000.0 / (sum(work) / len(requests))


def find_stress_rps(
    requests, base_rps, cfg, cost, start_rps: float, factor: float = 5.0, max_steps: int = 24
):
    """(light rps, light RR p99, stress rps, stress RR p99, reached): round robin's p99 at
    ``start_rps``, then at rates 1.5x apart until it is ``factor`` times that. ``reached``
    is false where the trace is too short to stress the cluster as a sustained load: no
    rate got there (its p99 is bounded by the time the cluster takes to serve all of it,
    and the last rate tried delivers it at once), or the rate that did delivered all of it
    in less time than that p99 (a burst, not a load). Benches that took such a rate for
    stress measured bursts (8B P/D cells at 18k requests a second), so callers say so."""
    span = max(r.arrival for r in requests) - min(r.arrival for r in requests)  # at base_rps
    with progress(total=max_steps + 1, desc="finding the stress rate", unit="run") as bar:
        light = run(at_rate(requests, base_rps, start_rps), "round_robin", cfg, cost)["p99_latency_s"]
        bar.update(1)
        rps = start_rps
        for _ in range(max_steps):
            rps *= 1.5
            p99 = run(at_rate(requests, base_rps, rps), "round_robin", cfg, cost)["p99_latency_s"]
            bar.update(1)
            bar.set_postfix_str(f"{rps:.2f} rps: p99 {p99:.2f}s (stress at {factor * light:.2f}s)")
            if p99 >= factor * light:
                return start_rps, light, rps, p99, span * base_rps / rps >= factor * light
    return start_rps, light, rps, p99, False


def not_stressed(what: str, n: int, rps: float, ratio: float) -> str:
    """What a search that never reached stress found, for the log and the record."""
    return (f"{what}: {n} requests are too few to stress this cluster as a load: round robin's p99 "
            f"came to {ratio:.1f}x its light-load p99 at {rps:.0f} rps, which delivers them in about "
            f"{n / rps:.2f} s, a burst; use more requests")  # fmt: skip


class StressNotReached(ValueError):
    """A trace too short to stress its cluster: no stress rate to run at."""

    def __init__(self, message: str, requests: int) -> None:
        super().__init__(message)
        self.requests = requests  # the trace's length


def stress_rps(requests: list[SimRequest], cfg: SimConfig, cost: CostModel | list[CostModel]) -> float:
    """The stress rate of a trace laid out at 1 rps: ``find_stress_rps`` from ``light_rate``
    (of the first instance's costs, where each has its own). Raises where the trace cannot
    stress the cluster: a bench would otherwise measure a burst and call it stress."""
    first = cost[0] if isinstance(cost, list) else cost
    _, light, rps, p99, reached = find_stress_rps(requests, 1.0, cfg, cost,
                                                  light_rate(requests, first, cfg.num_instances))  # fmt: skip
    if not reached:
        what = f"{cfg.num_instances} instances"
        raise StressNotReached(not_stressed(what, len(requests), rps, p99 / light), len(requests))
    return rps


def stress_trace(workload: str, n: int, cfg: SimConfig, cost, grow: int = 8) -> tuple[float, int]:
    """(stress rps, requests) for a bench's cell: ``stress_rps`` on the first trace of ``n``
    requests, doubled while it is too short to stress the cluster (up to ``grow`` times);
    raises ``StressNotReached`` past that."""
    size = n
    while True:
        try:
            return stress_rps(trace(workload, size, 1.0, 0), cfg, cost), size
        except StressNotReached:
            if size * 2 > n * grow:
                raise
            size *= 2


def stress_or_why(
    workload: str, n: int, cfg: SimConfig, cost, grow: int = 8
) -> tuple[float | None, int, str]:
    """``stress_trace`` for a bench's grid: (stress rps, requests, "") or, where even
    ``grow`` times ``n`` requests cannot stress the cluster, (None, the requests tried, why):
    the bench reports that cell as not run instead of losing every other cell's runs."""
    try:
        return (*stress_trace(workload, n, cfg, cost, grow), "")
    except StressNotReached as e:
        return None, e.requests, str(e)


@functools.lru_cache(maxsize=1)
def _cached_trace(workload: str, n: int, seed: int) -> list[SimRequest]:
    """A worker builds a trace once for the run of jobs on it (the jobs come trace by
    trace), not once per rate and policy; one at a time, since a trace can be ~100 MB."""
    return trace(workload, n, 1.0, seed)


def _run_job(job: tuple) -> dict:
    """One (trace seed, rate, policy) run; a top-level function so a process pool can run it."""
    workload, n, seed, rps, policy, cfg, cost = job
    return run(at_rate(_cached_trace(workload, n, seed), 1.0, rps), policy, cfg, cost)


def _mean_record(runs: list[dict]) -> dict:
    """The metrics averaged over the traces (each trace's own under ``per_seed``)."""
    keys = [k for k, v in runs[0].items() if isinstance(v, (int, float))]
    return {**{k: sum(r[k] for r in runs) / len(runs) for k in keys}, "per_seed": runs}


def sweep(
    workload: str,
    instances: int,
    n: int,
    cost: CostModel,
    cfg: SimConfig | None = None,
    policies=ALL_POLICIES,
    start_rps: float | None = None,
    seed: int = 0,
    seeds: int = 1,
    jobs: int = 1,
    cost_label: str = "",
    stress_rps: float | None = None,
    fractions: tuple[float, ...] = (0.25, 0.5, 0.75, 1.0),
    log=print,
) -> list[dict]:
    """The stress rate is found on trace ``seed`` (or given: ``stress_rps``, and then no
    light rate runs); every policy then runs at each rate on ``seeds`` traces (seed,
    seed + 1, ...: other requests, other arrivals), and each record holds the metrics
    averaged over them. One trace's ratio between two close policies moves by ±10% with
    the trace, so comparisons want several."""
    cfg = cfg or SimConfig.of(instances)
    base_rps = 1.0
    if stress_rps is None:
        requests = trace(workload, n, base_rps, seed)
        if start_rps is None:
            start_rps = light_rate(requests, cost, instances)
        light, light_p99, stress, stress_p99, reached = find_stress_rps(
            requests, base_rps, cfg, cost, start_rps
        )
        log(
            f"{workload} x{instances}: light {light:.2f} rps (RR p99 {light_p99:.2f}s), "
            f"stress {stress:.2f} rps (RR p99 {stress_p99:.2f}s)"
        )
        if not reached:
            log("warning: " + not_stressed(f"{workload} x{instances}", n, stress, stress_p99 / light_p99))
        extra = {light}
    else:
        stress, extra = stress_rps, set()
    rates = sorted({*extra, *(stress * k for k in fractions)})  # the knee on a linear axis
    grid = [(rps, policy) for rps in rates for policy in (*policies, *REFERENCES)]
    work = [(workload, n, seed + k, rps, policy, cfg, cost) for k in range(seeds) for rps, policy in grid]
    # Spawned, not forked: a fork of a process whose torch thread pool is running deadlocks.
    with ProcessPoolExecutor(jobs, mp_context=multiprocessing.get_context("spawn")) as pool:
        runs = list(progress(pool.map(_run_job, work), total=len(work), desc=f"{workload} x{instances}",
                             unit="run"))  # fmt: skip
    records = []
    for i, (rps, policy) in enumerate(grid):
        mean = _mean_record(runs[i :: len(grid)])  # this point's run on each trace
        rec = {"policy": policy, "workload": workload, "instances": instances, "rps": rps,
               "stress": rps == stress, "seeds": seeds, "cost_model": cost_label,
               "capacity_tokens": cfg.capacity_tokens, **mean}  # fmt: skip
        records.append(rec)
    over_reference(records)
    over_reference(records, "p99_latency_s")
    for rec in records:
        log(
            f"  {rec['rps']:7.2f} rps {rec['policy']:12s} avg {rec['avg_latency_s']:.3f}s "
            f"({rec['avg_latency_s_over_reference']:.2f}x ref) p99 {rec['p99_latency_s']:.3f}s "
            f"({rec['p99_latency_s_over_reference']:.2f}x ref) hit {rec['cache_hit_ratio']:.2f}"
        )
    return records


def plot(records: list[dict], path: str | Path) -> None:
    """Figure 5's picture: each point the mean over the traces, the bars their spread."""
    first = records[0]
    runs = [{**run, "policy": r["policy"], "rps": r["rps"]}
            for r in records for run in r.get("per_seed", [r])]  # fmt: skip
    kv = f", {first['capacity_tokens'] // 1000}k KV tokens each" if "capacity_tokens" in first else ""
    seeds = first.get("seeds", 1)
    caption = (f"{first['workload']}, {first['instances']} simulated instances{kv}, "
               f"{first.get('cost_model', '')}; mean of {seeds} trace(s) per point")  # fmt: skip
    latency_vs_rate(runs, path, caption)


def write(records: list[dict], out_dir: str | Path, name: str) -> None:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    # compressed, as every record under docs/sim/: they travel with each device call
    with gzip.GzipFile(out / f"{name}.json.gz", "wb", mtime=0) as f:
        f.write(json.dumps(records, indent=1).encode())
    plot(records, out / f"{name}.png")
