"""RPS sweeps in the simulator: every policy on the same trace, latency against load.

``find_stress_rps`` looks for the load the issue asks about: starting light, the request
rate grows by ×1.5 until round-robin's p99 latency is at least 5× its light-load p99.
``sweep`` then runs every policy at the light, the middle and the stress rate, on the
same requests and arrival times, and returns one ``simulator.metrics`` record per run.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from client.workloads import Materializer, generate, poisson_arrivals
from preble_backend.common.cost_model import CostModel
from scheduler.policies import make_policy
from scheduler.sim.simulator import SimConfig, SimRequest, metrics, simulate

BASELINES = ("round_robin", "least_load", "prefix_hash", "cache_aware", "kv_cost")
ALL_POLICIES = ("e2", *BASELINES)


def trace(workload: str, n: int, rps: float, seed: int = 0) -> list[SimRequest]:
    words = Materializer()
    reqs = poisson_arrivals(generate(workload, n, seed=seed), rps, seed=seed)
    return [
        SimRequest(f"{workload}-{i}", r.arrival, words.token_ids(r), r.output_len) for i, r in enumerate(reqs)
    ]


def cluster_facts(cfg: SimConfig, cost: CostModel, clock) -> dict:
    """What a policy may know of the simulated cluster."""
    return {
        "clock": clock,
        "cost_model": cost,
        "capacity_tokens": cfg.capacity_tokens,
        "page_size": cfg.page_size,
    }


def run(requests: list[SimRequest], policy: str, cfg: SimConfig, cost: CostModel, **options) -> dict:
    result = simulate(
        requests,
        lambda clock: make_policy(policy, cfg.num_instances, cluster_facts(cfg, cost, clock), **options),
        cfg,
        cost,
    )
    branches: dict[str, int] = {}
    for record in result.records.values():
        branches[record.branch] = branches.get(record.branch, 0) + 1
    return {**metrics(result), "branches": branches}


def _at_rate(requests: list[SimRequest], base_rps: float, rps: float) -> list[SimRequest]:
    return [
        SimRequest(r.request_id, r.arrival * base_rps / rps, r.input_ids, r.output_len, r.chains)
        for r in requests
    ]


def find_stress_rps(
    requests, base_rps, cfg, cost, start_rps: float, factor: float = 5.0, max_steps: int = 24
):
    """(light rps, light RR p99, stress rps, stress RR p99)."""
    light = run(_at_rate(requests, base_rps, start_rps), "round_robin", cfg, cost)["p99_latency_s"]
    rps = start_rps
    for _ in range(max_steps):
        rps *= 1.5
        p99 = run(_at_rate(requests, base_rps, rps), "round_robin", cfg, cost)["p99_latency_s"]
        if p99 >= factor * light:
            return start_rps, light, rps, p99
    return start_rps, light, rps, p99


def sweep(
    workload: str,
    instances: int,
    n: int,
    cost: CostModel,
    cfg: SimConfig | None = None,
    policies=ALL_POLICIES,
    start_rps: float | None = None,
    seed: int = 0,
    log=print,
) -> list[dict]:
    cfg = cfg or SimConfig.of(instances)
    base_rps = 1.0
    requests = trace(workload, n, base_rps, seed)
    if start_rps is None:  # ~5% of one instance's no-cache throughput per instance
        mean_ms = (
            sum(cost.prefill_time(len(r.input_ids)) + cost.decode_time(r.output_len) for r in requests) / n
        )
        start_rps = 0.05 * instances * 1000.0 / mean_ms
    light, light_p99, stress, stress_p99 = find_stress_rps(requests, base_rps, cfg, cost, start_rps)
    log(
        f"{workload} x{instances}: light {light:.2f} rps (RR p99 {light_p99:.2f}s), "
        f"stress {stress:.2f} rps (RR p99 {stress_p99:.2f}s)"
    )
    records = []
    for rps in sorted({light, math.sqrt(light * stress), stress}):
        at = _at_rate(requests, base_rps, rps)
        for policy in policies:
            rec = {
                "policy": policy,
                "workload": workload,
                "instances": instances,
                "rps": rps,
                "stress": rps == stress,
                **run(at, policy, cfg, cost),
            }
            records.append(rec)
            log(
                f"  {rps:7.2f} rps {policy:12s} avg {rec['avg_latency_s']:.3f}s "
                f"p99 {rec['p99_latency_s']:.3f}s hit {rec['cache_hit_ratio']:.2f}"
            )
    return records


def plot(records: list[dict], path: str | Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for policy in dict.fromkeys(r["policy"] for r in records):
        rows = sorted((r for r in records if r["policy"] == policy), key=lambda r: r["rps"])
        for ax, key in zip(axes, ("avg_latency_s", "p99_latency_s")):
            ax.plot([r["rps"] for r in rows], [r[key] for r in rows], marker="o", label=policy)
    first = records[0]
    for ax, title in zip(axes, ("average latency (s)", "p99 latency (s)")):
        ax.set_xlabel("requests per second")
        ax.set_title(f"{first['workload']}, {first['instances']} instances: {title}")
        ax.set_yscale("log")
        ax.grid(True, alpha=0.3)
    axes[0].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def write(records: list[dict], out_dir: str | Path, name: str) -> None:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.json").write_text(json.dumps(records, indent=1))
    plot(records, out / f"{name}.png")
