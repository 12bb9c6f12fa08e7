"""The live tenant bench's light-TTFT phase (``preble_backend/benchmarks/tenant_shares.py``)
in the simulator: two instances of ``mistral7b_a6000`` routed by E2, eight running slots
each; one light client asking without pause (~1,150-token prompts, 32 output tokens),
alone, then while 36 clients of a heavy tenant do the same. Its TTFT in each, with the
paper's queue alone (``fcfs``) and with fair shares.

The simulator runs the engines' own scheduler, so this says what the schedule gives the
light tenant without the live stack's host: the live bench measured the same alone TTFT
(0.178 s at the engines) and a flood's within 10% of this (``docs/BENCHMARKS.md``, 1.10).

    python -m scheduler.sim.light_ttft
"""

from __future__ import annotations

import argparse

import numpy as np

from preble_backend.common.cost_model import CostModel
from preble_backend.common.fair_share import TenantShares
from scheduler.policies import make_policy
from scheduler.sim.simulator import SimConfig, SimRequest, simulate
from scheduler.sim.sweep import cluster_facts

PROMPT, OUTPUT = 1154, 32  # the live bench's ~300-word prompts, as the tiny model tokenizes them


def client(tenant: str, k: int, n: int, start: float, rng: np.random.Generator) -> list[SimRequest]:
    """A client asking without pause: each request arrives as the one before finishes."""
    out, prev = [], None
    for i in range(n):
        rid = f"{tenant}{k}-{i}"
        ids = rng.integers(10, 32000, PROMPT).tolist()
        out.append(SimRequest(rid, start, ids, OUTPUT, after=prev, tenant=tenant))
        prev = rid
    return out


def light_ttft(fair_share: bool, flood_clients: int, cost: CostModel, instances: int = 2,
               max_running: int = 8, light_requests: int = 60) -> list[float]:  # fmt: skip
    """The light client's TTFTs, with ``flood_clients`` heavy ones asking from before it
    (each as many requests as the light one, started earlier and served no sooner, so the
    flood outlasts it). Deterministic: closed loops, and the prompts' tokens (random, none
    shared) change nothing."""
    rng = np.random.default_rng(0)
    requests = client("light", 0, light_requests, 10.0, rng)
    for k in range(flood_clients):
        requests += client("heavy", k, light_requests, 0.01 * k, rng)
    cfg = SimConfig.of(instances, 65536, fair_share=fair_share, max_running_requests=max_running)

    def e2(clock):
        return make_policy("e2", instances, cluster_facts(cfg, cost, clock))

    result = simulate(requests, e2, cfg, cost, shares=TenantShares() if fair_share else None)
    light = [r for rid, r in result.records.items() if rid.startswith("light")]
    return [r.first_token - r.arrival for r in light if r.first_token is not None]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--flood-clients", type=int, default=36)
    ap.add_argument("--cost-model", default="mistral7b_a6000")
    args = ap.parse_args()
    cost = CostModel.load(args.cost_model)
    for fair_share in (True, False):
        alone = light_ttft(fair_share, 0, cost)
        flood = light_ttft(fair_share, args.flood_clients, cost)
        name = "fair_share" if fair_share else "fcfs"
        print(f"{name}: light TTFT alone mean {np.mean(alone):.3f}s; with a flood mean {np.mean(flood):.3f}s "
              f"p50 {np.median(flood):.3f}s p99 {np.percentile(flood, 99):.3f}s "
              f"(x{np.mean(flood) / np.mean(alone):.2f} on the mean)")  # fmt: skip


if __name__ == "__main__":
    main()
