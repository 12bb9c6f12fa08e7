"""Benchmark: E2 scheduling decisions per second (the paper's global scheduler handled
245 requests/s on ToolBench with 1500 tools and 2931 on VideoQA).

Each decision is the full E2 path: match in the global prefix tree, load costs, the
choice, and recording it in the tree; every request is also completed with a cache
event, as engines would report, so the tree stays at its steady-state size. Usage:

    python -m scheduler.bench_decisions --instances 8 --requests 20000
"""

from __future__ import annotations

import argparse
import platform
import time

from client.workloads import WORKLOADS, Materializer
from preble_backend.radix_cache import CacheEvent
from preble_backend.sampling import SamplingParams
from scheduler.cost_model import CostModel
from scheduler.e2 import E2
from scheduler.policy import FinishInfo, InstanceLoad, RoutingRequest

PAPER = {"toolbench": 245, "videoqa": 2931}


def bench(workload: str, instances: int, n: int, **workload_kw) -> tuple[float, float]:
    """(decisions per second, seconds per decision) over ``n`` requests; completions are
    reported after a lag of ``4 × instances`` requests, as if that many were in flight."""
    words = Materializer()
    reqs = [words.token_ids(r) for r in WORKLOADS[workload](n, seed=0, **workload_kw)]
    params = SamplingParams()
    clock = [0.0]
    policy = E2(instances, cost_model=CostModel.load("mistral7b_a6000"), capacity_tokens=240_000,
                clock=lambda: clock[0])  # fmt: skip
    loads = [InstanceLoad() for _ in range(instances)]
    lag = 4 * instances
    routed: list[tuple[int, RoutingRequest]] = []
    start = time.perf_counter()
    for i, tokens in enumerate(reqs):
        clock[0] = i * 0.001
        request = RoutingRequest(str(i), tokens, params)
        routed.append((policy.select(request, loads).instance, request))
        if len(routed) > lag:
            inst, done = routed.pop(0)
            event = CacheEvent("stored", tuple(done.input_ids[: len(done.input_ids) // 16 * 16]), 0)
            policy.on_finish(inst, done, FinishInfo([event], {}, 0.1, 8))
    elapsed = time.perf_counter() - start
    return n / elapsed, elapsed / n


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--instances", type=int, default=8)
    parser.add_argument("--requests", type=int, default=20000)
    args = parser.parse_args(argv)
    machine = f"{platform.machine()}, {platform.python_implementation()} {platform.python_version()}"
    print(f"# E2 decisions/s, {args.instances} instances, {args.requests} requests; {machine}")
    print("| workload | decisions/s (incl. completions) | µs per decision | paper | ratio |")
    print("|---|---|---|---|---|")
    for workload, kw in (("toolbench", {"num_tools": 1500}), ("videoqa", {})):
        rate, per = bench(workload, args.instances, args.requests, **kw)
        paper = PAPER[workload]
        print(f"| {workload} | {rate:,.0f} | {per * 1e6:,.0f} | {paper} | {rate / paper:.1f}x |")


if __name__ == "__main__":
    main()
