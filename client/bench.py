"""``preble bench``: the paper's evaluation against a live server.

A workload trace (one of the paper's five, or a JSONL trace from ``preble workload
generate``) is replayed over gRPC streaming at each request rate (Poisson arrivals, the
same requests and arrival times for every policy) or at the trace's own timestamps. The
router's policy is switched by its admin control request, which also flushes every
engine's cache, so each run starts cold (the admin key: ``--admin-key``, else the one
``preble serve`` left for its port). Policies run interleaved
per rate (their order rotates between repeats). Per run: latency (average, p50, p99),
time to first token (average, p99), time per output token, throughput, cache hit ratio
(Σ ``num_cached_tokens`` / Σ prompt tokens), requests per engine, errors; plots like the
paper's Figure 5.

    preble bench --url 127.0.0.1:8001 --workload toolbench --requests 200 \\
        --rates 2,4,8 --policies e2,round_robin,cache_aware --output bench/
"""

from __future__ import annotations

import asyncio
import functools
import json
import time
from collections import Counter
from dataclasses import asdict, replace
from pathlib import Path

import numpy as np

from client.bench_config import BenchConfig, BenchRequest, Outcome
from client.bench_transports import TRANSPORTS, GrpcEngine, Spread, flush_engine
from client.plots import latency_vs_rate
from client.triton_client import PrebleClient
from client.workloads import Materializer, generate, poisson_arrivals
from preble_backend.common.keys import grpc_bearer
from preble_backend.common.procfs import cpu_seconds, process_role
from preble_backend.common.progress import progress


def build_trace(cfg: BenchConfig) -> tuple[list[BenchRequest], bool]:
    """The requests at rate 1 (arrivals to be scaled per rate), or a file's own arrivals
    (second value True: play as recorded). With ``direct`` each prompt is also tokenized,
    as the router would, for the engine."""
    tokenizer = None
    if cfg.tokenizer:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(cfg.tokenizer)
    if cfg.trace:
        rows = [json.loads(line) for line in Path(cfg.trace).read_text().splitlines() if line.strip()]
        rows = rows[: cfg.requests] if cfg.requests else rows
        start = rows[0]["arrival"] if rows else 0.0
        out = [
            BenchRequest(r["arrival"] - start, r["text_input"], int(r["max_tokens"]), after=r.get("after"),
                         think_s=float(r.get("think_s", 0.0)))
            for r in rows
        ]  # fmt: skip
    else:
        words = Materializer(tokenizer=tokenizer)
        reqs = poisson_arrivals(generate(cfg.workload, cfg.requests, cfg.seed, cfg.scale), 1.0, cfg.seed)
        out = [
            BenchRequest(
                r.arrival, words.text(r), r.output_len, after=r.after, think_s=r.think_s, group=r.group
            )
            for r in reqs
        ]
    if cfg.direct:
        if tokenizer is None:
            raise ValueError("--direct needs --tokenizer (an engine takes token ids)")
        for r in out:
            r.input_ids = tokenizer(r.prompt).input_ids
    return out, bool(cfg.trace)


# ---- switching the policy -------------------------------------------------------------------


def switch_policy(url: str, model: str, policy: str, key: str | None = None,
                  admin_key: str | None = None) -> None:  # fmt: skip
    """Switch the router to ``policy`` with every engine's cache flushed, through its admin
    control request (``router/cluster/admin.py``): no model is reloaded, so the server needs no
    model control. ``key``: the API key; ``admin_key``: the server's admin key."""
    PrebleClient(grpc_url=url, model=model, api_key=key).admin("configure", admin_key, policy=policy)


def _engine_address(entry: str) -> tuple[str, str]:
    """A router ``engines`` entry as (gRPC host:port, "" for the router's own server; model)."""
    where, _, model = entry.rpartition("=grpc://")[2].removeprefix("grpc://").rpartition("/")
    return where, model


def _parameters(where: str, name: str, key: str | None) -> dict[str, str]:
    import tritonclient.grpc as grpcclient

    client = grpcclient.InferenceServerClient(where)
    try:
        config = client.get_model_config(name, as_json=True, headers=dict(grpc_bearer(key)))["config"]
    finally:
        client.close()
    return {k: v.get("string_value", "") for k, v in config.get("parameters", {}).items()}


def _cluster(url: str, model: str, key: str | None) -> tuple[list[str], dict[str, str]]:
    """The router's engines and its parameters, overlaid with the first engine's where
    that can be read (an engine's key is not a client's: usually it cannot)."""
    router = _parameters(url, model, key)
    engines = [e for e in router.get("engines", "").split(",") if e]
    first = dict(router)
    if engines:
        where, name = _engine_address(engines[0])
        try:
            first.update(_parameters(where or url, name, key))
        except Exception:
            pass
    return engines, first


def served_model_path(url: str, model: str, key: str | None = None) -> str:
    """The engines' ``model_path`` as the router's first engine names it ("" if unknown)."""
    return _cluster(url, model, key)[1].get("model_path", "")


def describe_cluster(url: str, model: str, key: str | None = None) -> str:
    """What the router routes to, for a plot's caption: engine count, model or emulation."""
    engines, first = _cluster(url, model, key)
    if first.get("compute") == "emulated":
        what = f"emulated {first.get('cost_model', '')}, slowdown {first.get('emulated_slowdown', '1')}"
    else:
        what = f"model {first.get('model_path', '?')}"
    return f"{len(engines)} engines ({what})"


# ---- one run -------------------------------------------------------------------------------


async def _one(
    transport, req: BenchRequest, start: float, timeout_s: float, started: list, before
) -> Outcome:
    """Send at the request's arrival, or ``think_s`` after the answer it follows (``before``)."""
    if before is None:
        await asyncio.sleep(max(0.0, start + req.arrival - time.monotonic()))
    else:
        await before.wait()
        await asyncio.sleep(req.think_s)
    out = Outcome(sent=time.monotonic() - start)
    started.append(out)
    try:
        await asyncio.wait_for(transport(req, out, start), timeout_s)
    except Exception as exc:  # a transport failure or a timeout is an outcome too
        out.error = f"{type(exc).__name__}: {exc}"
    return out


async def _watch(started: list[Outcome], stall_s: float) -> str:
    """Return once requests are open and no token or answer has arrived for ``stall_s``:
    a server that stopped answering (a dead router stub keeps its streams open) ends the
    run then, not each request's timeout later. Streaming answers move every iteration,
    so silence this long is not a queue."""
    last, quiet_since = None, time.monotonic()
    while True:
        await asyncio.sleep(min(1.0, stall_s / 4))
        now = time.monotonic()
        seen = (sum(o.output_tokens for o in started), sum(o.finished is not None or o.error is not None
                                                           for o in started))  # fmt: skip
        waiting = seen[1] < len(started)
        if seen != last or not waiting:
            last, quiet_since = seen, now
        elif now - quiet_since >= stall_s:
            return f"no answer for {stall_s:g} s with {len(started) - seen[1]} requests open"


async def _replay(make_transport, requests: list[BenchRequest], timeout_s: float, stall_s: float, bar):
    """Every request at its arrival time; if the server falls silent (``_watch``), what
    is still unanswered ends with the reason as its error."""
    transport = make_transport()  # inside the event loop: its connections belong to it
    start, started = time.monotonic(), []
    answered = [asyncio.Event() for _ in requests]  # closed-loop conversations wait on these

    async def tracked(i, req):
        before = None if req.after is None else answered[req.after]
        try:
            return await _one(transport, req, start, timeout_s, started, before)
        finally:
            answered[i].set()
            bar.update(1)

    tasks = [asyncio.ensure_future(tracked(i, r)) for i, r in enumerate(requests)]
    watchdog = asyncio.ensure_future(_watch(started, stall_s))
    try:
        await asyncio.wait([asyncio.gather(*tasks), watchdog], return_when=asyncio.FIRST_COMPLETED)
        reason = watchdog.result() if watchdog.done() else None
        for task in tasks:
            task.cancel()
        results = await asyncio.gather(*tasks, return_exceptions=True)
        return [r if isinstance(r, Outcome) else Outcome(sent=req.arrival, error=reason or repr(r))
                for r, req in zip(results, requests)]  # fmt: skip
    finally:
        watchdog.cancel()
        await transport.close()


def new_group_tpot(outcomes: list[Outcome], groups: list[str]) -> list[float]:
    """The TPOT of each request that was decoding when a request of a group not seen before
    in the run was sent (a new document in loogle and shifting_docs: a long prefill that
    nothing cached): the interference prefill/decode disaggregation exists to remove.
    Unshared prompts (``background``) are not documents."""
    seen: set[str] = set()
    arrivals = []
    for o, group in sorted(zip(outcomes, groups), key=lambda pair: pair[0].sent):
        if group and group != "background" and group not in seen:
            seen.add(group)
            arrivals.append(o.sent)
    done = [o for o in outcomes if o.error is None and o.finished is not None and o.first_token is not None]
    return [(o.finished - o.first_token) / (o.output_tokens - 1) for o in done
            if o.output_tokens > 1 and any(o.first_token < t < o.finished for t in arrivals)]  # fmt: skip


def summarize(outcomes: list[Outcome], groups: list[str] | None = None) -> dict:
    """A run's record (the fields of the simulator's records, plus errors and engines);
    with each request's group, the TPOT of those decoding while a new document arrived."""
    done = [o for o in outcomes if o.error is None and o.finished is not None and o.first_token is not None]
    errors = Counter(o.error or "no final response" for o in outcomes if o not in done)
    record: dict = {"num_requests": len(outcomes), "completed": len(done), "errors": dict(errors)}
    if not done:
        return record
    lat = np.array([o.finished - o.sent for o in done])
    ttft = np.array([o.first_token - o.sent for o in done])
    tpot = [(o.finished - o.first_token) / (o.output_tokens - 1) for o in done if o.output_tokens > 1]
    span = max(o.finished for o in done) - min(o.sent for o in done)
    return {
        **record,
        "avg_latency_s": float(lat.mean()),
        "p50_latency_s": float(np.percentile(lat, 50)),
        "p99_latency_s": float(np.percentile(lat, 99)),
        "avg_ttft_s": float(ttft.mean()),
        "p99_ttft_s": float(np.percentile(ttft, 99)),
        "avg_tpot_s": float(np.mean(tpot)) if tpot else 0.0,
        "p99_tpot_s": float(np.percentile(tpot, 99)) if tpot else 0.0,  # the interference a prefill causes
        "throughput_rps": len(done) / span if span > 0 else 0.0,
        "cache_hit_ratio": sum(o.cached_tokens for o in done) / max(1, sum(o.input_tokens for o in done)),
        "prompt_tokens": sum(o.input_tokens for o in done),
        "output_tokens": sum(o.output_tokens for o in done),
        "per_engine": dict(Counter(o.instance for o in done)),
        **new_doc_fields(outcomes, groups),
    }


def new_doc_fields(outcomes: list[Outcome], groups: list[str] | None) -> dict:
    tpot = new_group_tpot(outcomes, groups) if groups and any(groups) else []
    if not tpot:
        return {}
    return {"new_doc_decoding": len(tpot), "p99_tpot_new_doc_s": float(np.percentile(tpot, 99)),
            "avg_tpot_new_doc_s": float(np.mean(tpot))}  # fmt: skip


def bench(cfg: BenchConfig, log=print) -> list[dict]:
    """Every policy at every rate, interleaved, ``repeats`` times; one record per run."""
    if len(cfg.urls) > 1 and cfg.transport != "grpc":
        raise ValueError("several --url routers take --transport grpc (sse has one --http-url)")
    base, recorded = build_trace(cfg)
    rates = [None] if recorded else cfg.rates
    records = []
    order = list(cfg.policies) + (["direct"] if cfg.direct else [])
    if cfg.direct:  # an engine this server does not host fails now, not after the policies' runs
        flush_engine(cfg.urls[0], cfg.direct)
    for repeat in range(cfg.repeats):
        for rps in rates:
            for policy in order:
                speed = 1.0 if rps is None else rps  # a recorded trace plays as recorded
                requests = [replace(r, arrival=r.arrival / speed, think_s=r.think_s / speed) for r in base]
                if policy == "direct":
                    flush_engine(cfg.urls[0], cfg.direct)
                    make = functools.partial(GrpcEngine, replace(cfg, url=cfg.urls[0], model=cfg.direct))
                else:
                    for url in cfg.urls:
                        switch_policy(url, cfg.model, policy, cfg.api_key, cfg.admin_key)
                    transport = TRANSPORTS[cfg.transport]
                    make = functools.partial(Spread, [functools.partial(transport, replace(cfg, url=u))
                                                      for u in cfg.urls])  # fmt: skip
                desc = f"{policy} @ {'trace' if rps is None else f'{rps:g} rps'}"
                cpu, stack = HostCPU(), StackCPU()
                with progress(total=len(requests), desc=desc, unit="req") as bar:
                    outcomes = asyncio.run(_replay(make, requests, cfg.timeout_s, cfg.stall_s, bar))
                rec = {"policy": policy, "workload": cfg.trace or cfg.workload, "rps": rps,
                       "repeat": repeat, **summarize(outcomes, [r.group for r in requests]),
                       "host_cpu_busy": cpu.busy()}  # fmt: skip
                rec.update(router_cost(rec, stack.spent(), cfg.model))
                if policy != "direct" and cfg.admin_key:  # what E2 priced each engine with, by then
                    status = PrebleClient(grpc_url=cfg.urls[0], model=cfg.model, api_key=cfg.api_key).admin(
                        "status", cfg.admin_key)  # fmt: skip
                    rec["cost_models"] = status.get("cost_models", {})
                records.append(rec)
                log(summary_line(rec))
        order = order[1:] + order[:1]  # the next repeat starts with another policy
    return records


class HostCPU:
    """The fraction of this host's CPU time spent busy since construction (from
    ``/proc/stat``; None where there is none). With the server on the same host, a run
    near 1.0 measured the host — router, engine loops, this client — not the policies.
    Time at nice > 0 is not counted: work run niced yields the CPU to the stack."""

    def __init__(self) -> None:
        self.start = self._read()

    @staticmethod
    def _read() -> list[int] | None:
        try:
            fields = Path("/proc/stat").read_text().splitlines()[0].split()[1:]
        except OSError:
            return None
        return [int(f) for f in fields]

    def busy(self) -> float | None:
        end = self._read()
        if self.start is None or end is None:
            return None
        delta = [b - a for a, b in zip(self.start, end)]
        idle = delta[1] + delta[3] + delta[4]  # nice + idle + iowait
        return round(1.0 - idle / sum(delta), 3) if sum(delta) else None


class StackCPU:
    """CPU seconds spent by tritonserver and each model's stub on this host between
    construction and ``spent()``, keyed by role (``tritonserver``, ``stub:preble``, ...);
    empty where there is no ``/proc`` or no stack here. Per run, ``bench`` divides the
    router stub's by the requests and the tokens it streamed."""

    def __init__(self) -> None:
        self.start = self._read()

    @staticmethod
    def _read() -> dict[int, tuple[str, float]]:
        seen = {}
        for entry in Path("/proc").glob("[0-9]*"):
            role = process_role(int(entry.name))
            if role and (role == "tritonserver" or role.startswith("stub:")):
                if (spent := cpu_seconds(int(entry.name))) is not None:
                    seen[int(entry.name)] = (role, spent)
        return seen

    def spent(self) -> dict[str, float]:
        """A process started during the run counts from zero; one that ended is lost."""
        totals: dict[str, float] = {}
        for pid, (role, now) in self._read().items():
            totals[role] = round(totals.get(role, 0.0) + now - self.start.get(pid, (role, 0.0))[1], 3)
        return totals


def router_cost(rec: dict, cpu: dict[str, float], router: str) -> dict:
    """The router stub's CPU per completed request and per streamed token, and the
    stack's (every stub and tritonserver) per request."""
    done, tokens = rec.get("completed", 0), rec.get("output_tokens", 0)
    if not cpu or not done:
        return {"cpu_s": cpu}
    return {
        "cpu_s": cpu,
        "router_cpu_ms_per_request": 1e3 * cpu.get(f"stub:{router}", 0.0) / done,
        "router_cpu_ms_per_token": 1e3 * cpu.get(f"stub:{router}", 0.0) / max(1, tokens),
        "stack_cpu_ms_per_request": 1e3 * sum(cpu.values()) / done,
    }


def summary_line(rec: dict) -> str:
    if "avg_latency_s" not in rec:
        done = f"{rec['completed']}/{rec['num_requests']}"
        return f"  {rec['policy']:12s} {done} completed, errors {rec['errors']}"
    failed = "".join(f"\n    {n} failed: {why}" for why, n in rec["errors"].items())
    return (
        f"  {rec['policy']:12s} rps {rec['rps']} avg {rec['avg_latency_s']:.3f}s "
        + (f"({ratio:.2f}x ref) " if (ratio := rec.get("avg_latency_s_over_reference")) is not None else "")
        + "p99 "
        f"{rec['p99_latency_s']:.3f}s ttft {rec['avg_ttft_s']:.3f}s "
        + (f"tpot p99 {tpot * 1e3:.1f}ms " if (tpot := rec.get("p99_tpot_s")) is not None else "")
        + (f"(new docs {new * 1e3:.1f}ms) " if (new := rec.get("p99_tpot_new_doc_s")) is not None else "")
        + f"hit {rec['cache_hit_ratio']:.2f} "
        f"{rec['completed']}/{rec['num_requests']} "
        + (f"host cpu {rec['host_cpu_busy']:.0%} " if rec.get("host_cpu_busy") is not None else "")
        + (
            f"router cpu {rec['router_cpu_ms_per_request']:.1f} ms/req {rec['router_cpu_ms_per_token']:.3f} "
            f"ms/token, stack {rec['stack_cpu_ms_per_request']:.1f} ms/req "
            if "router_cpu_ms_per_request" in rec
            else ""
        )
        + f"engines {rec['per_engine']}"
        + failed
    )


def write(records: list[dict], cfg: BenchConfig, out_dir: str | Path, caption: str) -> tuple[Path, Path]:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    name = Path(cfg.trace).stem if cfg.trace else cfg.workload
    data, image = out / f"bench_{name}.json", out / f"bench_{name}.png"
    data.write_text(json.dumps({"config": asdict(cfg), "runs": records}, indent=1))
    latency_vs_rate([r for r in records if r.get("rps") is not None and "avg_latency_s" in r], image, caption)
    return data, image
