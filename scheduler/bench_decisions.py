"""Benchmark: E2 scheduling decisions per second (the paper's global scheduler handled
245 requests/s on ToolBench with 1500 tools and 2931 on VideoQA).

The trace runs through the simulator, so the global tree and the load views are in the
state real engines would put them in (caches fill, evict and report); only the time
spent inside the policy is counted: ``select`` for every request, plus ``on_finish``
(applying the engine's cache events) for every completion. Usage:

    python -m scheduler.bench_decisions --instances 8 --requests 10000
"""

from __future__ import annotations

import argparse
import platform
import time

from client.workloads import WORKLOADS, Materializer, poisson_arrivals
from scheduler.cost_model import CostModel
from scheduler.e2 import E2
from scheduler.simulator import SimConfig, SimRequest, simulate

PAPER = {"toolbench": 245, "videoqa": 2931}


def bench(workload: str, instances: int, n: int, rps: float, **workload_kw) -> tuple[float, float, float]:
    """(decisions per second, µs per select, µs per on_finish) inside a simulated run."""
    words = Materializer()
    reqs = poisson_arrivals(WORKLOADS[workload](n, seed=0, **workload_kw), rps, seed=0)
    trace = [SimRequest(str(i), r.arrival, words.token_ids(r), r.output_len) for i, r in enumerate(reqs)]
    cost = CostModel.load("mistral7b_a6000")
    cfg = SimConfig(num_instances=instances)
    spent = {"select": 0.0, "finish": 0.0}

    def factory(clock):
        policy = E2(instances, cost_model=cost, capacity_tokens=cfg.capacity_tokens, clock=clock)
        select, finish = policy.select, policy.on_finish

        def timed_select(request, loads):
            start = time.perf_counter()
            decision = select(request, loads)
            spent["select"] += time.perf_counter() - start
            return decision

        def timed_finish(instance, request, info):
            start = time.perf_counter()
            finish(instance, request, info)
            spent["finish"] += time.perf_counter() - start

        policy.select, policy.on_finish = timed_select, timed_finish
        return policy

    simulate(trace, factory, cfg, cost)
    total = spent["select"] + spent["finish"]
    return n / total, spent["select"] / n * 1e6, spent["finish"] / n * 1e6


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--instances", type=int, default=8)
    parser.add_argument("--requests", type=int, default=10000)
    args = parser.parse_args(argv)
    machine = f"{platform.machine()}, {platform.python_implementation()} {platform.python_version()}"
    print(f"# E2 decisions/s, {args.instances} instances, {args.requests} requests; {machine}")
    print(
        "| workload | decisions/s (select + on_finish) | µs per select | µs per on_finish | paper | ratio |"
    )
    print("|---|---|---|---|---|---|")
    for workload, rps, kw in (("toolbench", 60.0, {"num_tools": 1500}), ("videoqa", 8.0, {})):
        rate, sel, fin = bench(workload, args.instances, args.requests, rps, **kw)
        paper = PAPER[workload]
        print(f"| {workload} | {rate:,.0f} | {sel:,.0f} | {fin:,.0f} | {paper} | {rate / paper:.1f}x |")


if __name__ == "__main__":
    main()
