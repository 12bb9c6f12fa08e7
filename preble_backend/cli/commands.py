"""The ``preble`` command's subcommands, one function each (their options: ``options.py``)."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

from client.bench import BenchConfig, bench, describe_cluster, served_model_path
from client.bench import write as write_bench
from client.workloads import Materializer, generate, poisson_arrivals
from preble_backend.cli.cost_line import announce, engine_facts
from preble_backend.common.cost_model import CostModel
from preble_backend.common.keys import ADMIN_KEY_ENV, API_KEY_ENV
from preble_backend.common.settings import check_roles
from preble_backend.engine.config import EngineConfig
from preble_backend.engine.engine import Engine
from preble_backend.model.model_card import model_card
from preble_backend.model.pypi_models import fetch as fetch_model
from preble_backend.model.pypi_models import resolve as resolve_model
from preble_backend.runtime.access import read_admin_key
from preble_backend.runtime.repository import write_repository
from scheduler.cost_priors import parse_setting
from scheduler.sim.profile import profile
from scheduler.sim.replay import replay
from scheduler.sim.simulator import SimConfig
from scheduler.sim.sweep import sweep, write
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


def repo(args: argparse.Namespace) -> int:
    gpus = [int(g) for g in args.gpus.split(",")] if args.gpus else None
    remotes = [r for r in (args.remote or "").split(",") if r]
    fit = parse_setting(args.cost_model)[1] or "tiny_cpu"  # what an emulated engine waits out
    engine = {"compute": args.compute, "cost_model": fit, "emulated_slowdown": args.slowdown,
              "attention_backend": args.attention_backend,
              "tensor_parallel_size": args.tensor_parallel}  # fmt: skip
    if args.max_num_tokens is not None:
        engine["max_num_tokens"] = args.max_num_tokens
    if args.host_kv_tokens:
        engine["host_kv_tokens"] = args.host_kv_tokens
        engine["host_copy_ahead"] = args.host_copy_ahead
    if args.kv_transfer:
        engine["kv_transfer"] = True
    roles, cpu_engines = None, args.cpu_engines
    if args.prefill_engines or args.decode_engines:
        roles = ["prefill"] * args.prefill_engines + ["decode"] * args.decode_engines
        cpu_engines = len(roles)
    root = write_repository(
        args.output, args.model_path, gpus=gpus, cpu_engines=cpu_engines, remote_engines=remotes, roles=roles,
        router_overrides={"policy": args.policy, "cost_model": args.cost_model},
        router_instances=args.router_instances,
        host_cores=None if args.no_pin else len(os.sched_getaffinity(0)), **engine,
    )  # fmt: skip
    print(f"wrote {root}: {', '.join(sorted(p.name for p in root.iterdir()))}")
    device = f"cuda:{gpus[0]}" if gpus else "cpu"
    card = None
    if args.compute != "emulated":
        card = model_card(args.model_path, resolve_model(args.model_path), "auto", device.partition(":")[0])
    facts = engine_facts(card, device, args.tensor_parallel, args.compute, fit, args.slowdown)
    announce(args.cost_model, facts, "preble repo")
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
                if r.after is not None:  # a conversation's turn: played after that row's answer
                    row.update(after=r.after, think_s=r.think_s)
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
    cfg = SimConfig.of(args.instances, args.capacity_tokens, host_kv_tokens=args.host_kv_tokens,
                       host_copy_ahead=args.host_copy_ahead)  # fmt: skip
    records = sweep(args.workload, args.instances, args.requests, cost, cfg, tuple(args.policies),
                    seed=args.seed, seeds=args.seeds, jobs=args.jobs, cost_label=args.cost_model,
                    stress_rps=args.stress_rps, fractions=tuple(args.fractions))  # fmt: skip
    name = f"{args.workload}_{args.instances}"
    if args.capacity_tokens != SimConfig().capacity_tokens:
        name += f"_kv{args.capacity_tokens // 1000}k"
    if args.host_kv_tokens:
        name += f"_host{args.host_kv_tokens // 1000}k" + ("" if args.host_copy_ahead else "_in_line")
    write(records, args.output, name)
    print(f"wrote {args.output}/{name}.json.gz and .png")
    return 0


def bench_cmd(args: argparse.Namespace) -> int:
    key = _bench_key(args)
    if not args.tokenizer and not args.simulate and not args.trace:
        args.tokenizer = _served_tokenizer(served_model_path(args.url.split(",")[0], args.model, key))
        print(
            f"prompts sized in the served model's tokens ({args.tokenizer})"
            if args.tokenizer
            else "prompts sized in words: the served model's tokenizer is not on this host (--tokenizer)"
        )
    cfg = BenchConfig(
        url=args.url, model=args.model, workload=args.workload, trace=args.trace, requests=args.requests,
        rates=args.rates, policies=args.policies,
        repeats=args.repeats, scale=args.scale, seed=args.seed,
        tokenizer=resolve_model(args.tokenizer) if args.tokenizer else None,
        transport=args.transport, http_url=args.http_url, direct=args.direct, api_key=key,
        admin_key=None if args.simulate else _admin_key(args),
    )  # fmt: skip
    if not cfg.trace:  # the scaled trace keeps the paper's sharing structure: show it
        reqs = generate(cfg.workload, cfg.requests, cfg.seed, cfg.scale)
        words = Materializer()
        stats = summarize([words.token_ids(r) for r in reqs], [r.output_len for r in reqs])
        print(summary_table(f"{cfg.workload} at scale {cfg.scale}", stats, paper=cfg.workload))
    if args.simulate:
        cost = CostModel.load(args.cost_model).scaled(args.slowdown)
        sim = SimConfig.of(args.simulate, args.capacity_tokens, host_kv_tokens=args.host_kv_tokens,
                           host_copy_ahead=args.host_copy_ahead)  # fmt: skip
        roles = sim_roles(args.simulate, args.prefill_engines, args.decode_engines, args.kv_transfer)
        records = replay(cfg, sim, cost, roles=roles, kv_gbps=args.kv_gbps, tpot_slo_ms=args.tpot_slo_ms,
                         ttft_slo_ms=args.ttft_slo_ms)  # fmt: skip
        cluster = f"{args.simulate} simulated instances ({args.cost_model}, slowdown {args.slowdown:g})"
        if roles:
            pd = f"{args.prefill_engines} P + {args.decode_engines} D" if args.prefill_engines else "any pair"
            cluster += f", {pd} at {args.kv_gbps:g} GB/s"
    else:
        cluster = describe_cluster(cfg.urls[0], cfg.model, cfg.api_key)
        if len(cfg.urls) > 1:
            cluster += f", {len(cfg.urls)} routers"
        records = bench(cfg)
    caption = args.caption or (
        f"{cfg.trace or cfg.workload} x{cfg.scale:g}, {cfg.requests} requests; {cluster}; {cfg.transport}"
    )
    data, image = write_bench(records, cfg, args.output, caption)
    print(f"wrote {data} and {image}")
    return 0 if all(r["completed"] == r["num_requests"] for r in records) else 1


def sim_roles(instances: int, prefill: int, decode: int, kv_transfer: bool = False) -> tuple[str, ...]:
    """The simulated instances' roles, as ``preble repo`` writes them: the first ``prefill``
    prefill, the next ``decode`` decode, any others both; none without either, unless the
    instances move KV (``kv_transfer``: every instance both, and any two may pair)."""
    if not prefill and not decode:
        return ("both",) * instances if kv_transfer else ()
    if prefill < 0 or decode < 0 or prefill + decode > instances:
        raise ValueError(f"--prefill-engines {prefill} and --decode-engines {decode} need that many of the "
                         f"--simulate {instances} instances")  # fmt: skip
    roles = ("prefill",) * prefill + ("decode",) * decode + ("both",) * (instances - prefill - decode)
    check_roles(roles)
    return roles


def _served_tokenizer(model_path: str) -> str | None:
    """The served model's directory when this host has it (a preble model name, or a
    directory that exists here), so the bench sizes prompts in its tokens."""
    if not model_path:
        return None
    try:
        return resolve_model(model_path)
    except ValueError:  # a directory this host does not have
        return None


def _bench_key(args: argparse.Namespace) -> str | None:
    """``--api-key``, else ``PREBLE_API_KEY``: what every request carries."""
    return args.api_key or os.environ.get(API_KEY_ENV) or None


def _admin_key(args: argparse.Namespace) -> str | None:
    """``--admin-key``, else ``PREBLE_ADMIN_KEY``, else the admin key that ``preble serve``
    left for the server at ``--url`` (policies are switched with it)."""
    key = args.admin_key or os.environ.get(ADMIN_KEY_ENV)
    if key:
        return key
    port = args.url.split(",")[0].rpartition(":")[2]
    return read_admin_key(int(port)) if port.isdigit() else None


def model_cmd(args: argparse.Namespace) -> int:
    print(fetch_model(args.name))
    return 0
