"""A burst of simultaneous clients against the router, the way production traffic arrives.

Every request is sent at the same moment, over a mix of the router's three streaming
paths (HTTP SSE ``/generate_stream``, plain ``/generate``, gRPC streaming), with long
prompts that share a few prefixes. Each outcome is kept: its text, or the server's error
message. The report says how many completed, what the errors said, the latency
percentiles and the peak resident memory of every server process (``VmHWM``).

    python -m client.stress --http 127.0.0.1:8000 --grpc 127.0.0.1:8001 --requests 1000
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from client.triton_client import infer_inputs
from preble_backend.common.procfs import process_role, process_tree

KINDS = ("sse", "generate", "grpc")


@dataclass
class BurstConfig:
    http_url: str = "127.0.0.1:8000"
    grpc_url: str = "127.0.0.1:8001"
    model: str = "preble"
    requests: int = 200
    max_tokens: int = 64
    prefixes: int = 4
    prefix_words: int = 600  # long shared prompts: ~1k tokens of the tiny model
    suffix_words: int = 12
    kinds: tuple[str, ...] = KINDS
    timeout_s: float = 600.0
    seed: int = 0


@dataclass
class Outcome:
    kind: str
    latency_s: float
    text: str = ""
    error: str | None = None
    finish_reason: str | None = None


@dataclass
class BurstReport:
    requests: int
    completed: int  # finished with text and no error
    errors: dict[str, int] = field(default_factory=dict)  # message -> count
    by_kind: dict[str, int] = field(default_factory=dict)  # completed per path
    p50_latency_s: float = 0.0
    p99_latency_s: float = 0.0
    max_latency_s: float = 0.0
    wall_s: float = 0.0
    peak_rss_mib: dict[str, float] = field(default_factory=dict)


def burst_prompts(cfg: BurstConfig) -> list[str]:
    """``cfg.requests`` prompts: one of ``cfg.prefixes`` long shared prefixes, then a
    question of their own."""
    rng = random.Random(cfg.seed)
    words = "system tool schema returns field value agent video frame answer query".split()
    prefixes = [" ".join(rng.choice(words) for _ in range(cfg.prefix_words)) for _ in range(cfg.prefixes)]
    return [
        f"{prefixes[i % cfg.prefixes]}\nQuestion {i}: "
        + " ".join(rng.choice(words) for _ in range(cfg.suffix_words))
        for i in range(cfg.requests)
    ]


def _params(cfg: BurstConfig) -> str:
    return json.dumps({"max_tokens": cfg.max_tokens, "temperature": 0, "ignore_eos": True})


async def _http(session, cfg: BurstConfig, prompt: str, stream: bool) -> Outcome:
    kind = "sse" if stream else "generate"
    body = {"text_input": prompt, "sampling_parameters": _params(cfg), "exclude_input_in_output": True,
            "return_finish_reason": True}  # fmt: skip
    if stream:
        body["stream"] = True
    path = "generate_stream" if stream else "generate"
    start = time.monotonic()
    out = Outcome(kind, 0.0)
    async with session.post(f"http://{cfg.http_url}/v2/models/{cfg.model}/{path}", json=body) as resp:
        if resp.status != 200:
            text = await resp.text()
            try:
                out.error = json.loads(text)["error"]
            except (ValueError, KeyError):
                out.error = f"HTTP {resp.status}: {text[:200]}"
        elif stream:
            async for line in resp.content:
                line = line.decode().strip()
                if not line.startswith("data:"):
                    continue
                event = json.loads(line[5:])
                if "error" in event:
                    out.error = event["error"]
                    break
                out.text += event.get("text_output", "")
                out.finish_reason = event.get("finish_reason", out.finish_reason)
        else:
            answer = await resp.json()
            out.text, out.finish_reason = answer.get("text_output", ""), answer.get("finish_reason")
    out.latency_s = time.monotonic() - start
    return out


async def _grpc(client, cfg: BurstConfig, prompt: str) -> Outcome:
    inputs = infer_inputs({"text_input": prompt, "stream": True, "sampling_parameters": _params(cfg),
                           "return_finish_reason": True})  # fmt: skip

    async def one():
        yield {"model_name": cfg.model, "inputs": inputs,
               "parameters": {"triton_enable_empty_final_response": True}}  # fmt: skip

    start = time.monotonic()
    out = Outcome("grpc", 0.0)
    async for result, error in client.stream_infer(one()):
        if error is not None:
            out.error = error.message() if hasattr(error, "message") else str(error)
            break
        response = result.get_response()
        names = {o.name for o in response.outputs}
        if "text_output" in names:
            out.text += bytes(result.as_numpy("text_output").reshape(-1)[0]).decode()
        if "finish_reason" in names:
            out.finish_reason = bytes(result.as_numpy("finish_reason").reshape(-1)[0]).decode()
        if response.parameters["triton_final_response"].bool_param:
            break
    out.latency_s = time.monotonic() - start
    return out


async def _burst(cfg: BurstConfig, prompts: list[str]) -> tuple[list[Outcome], float]:
    import aiohttp
    import tritonclient.grpc.aio as grpcaio

    timeout = aiohttp.ClientTimeout(total=cfg.timeout_s)
    # Every client at once and on a connection of its own, as distinct clients arrive.
    connector = aiohttp.TCPConnector(limit=0, force_close=True)
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
        grpc_client = grpcaio.InferenceServerClient(cfg.grpc_url)

        async def run(i: int, prompt: str) -> Outcome:
            kind = cfg.kinds[i % len(cfg.kinds)]
            start = time.monotonic()
            try:
                call = (
                    _grpc(grpc_client, cfg, prompt)
                    if kind == "grpc"
                    else _http(session, cfg, prompt, kind == "sse")
                )
                return await asyncio.wait_for(call, cfg.timeout_s)
            except Exception as exc:  # a transport failure is an outcome too
                return Outcome(kind, time.monotonic() - start, error=f"{type(exc).__name__}: {exc}")

        start = time.monotonic()
        try:
            outcomes = await asyncio.gather(*(run(i, p) for i, p in enumerate(prompts)))
        finally:
            await grpc_client.close()
        return list(outcomes), time.monotonic() - start


def peak_rss_mib(pids: list[int]) -> dict[str, float]:
    """Peak resident memory (``VmHWM``) of each process, keyed ``name[pid]``."""
    peaks = {}
    for pid in pids:
        try:
            status = Path(f"/proc/{pid}/status").read_text()
        except OSError:
            continue
        fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
        name = process_role(pid) or fields["Name"].strip()
        peaks[f"{name}[{pid}]"] = int(fields.get("VmHWM", "0 kB").split()[0]) / 1024
    return peaks


def run_burst(cfg: BurstConfig, server_pid: int | None = None) -> tuple[BurstReport, list[Outcome]]:
    outcomes, wall = asyncio.run(_burst(cfg, burst_prompts(cfg)))
    done = [o for o in outcomes if o.error is None and o.text]
    failed = [o for o in outcomes if o.error is not None or not o.text]
    latencies = sorted(o.latency_s for o in outcomes)
    report = BurstReport(
        requests=len(outcomes),
        completed=len(done),
        errors=dict(Counter(o.error or "empty answer" for o in failed)),
        by_kind=dict(Counter(o.kind for o in done)),
        p50_latency_s=float(np.percentile(latencies, 50)),
        p99_latency_s=float(np.percentile(latencies, 99)),
        max_latency_s=latencies[-1],
        wall_s=wall,
    )
    if server_pid is not None:
        report.peak_rss_mib = peak_rss_mib(process_tree(server_pid))
    return report, outcomes


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--http", default=BurstConfig.http_url, help="HTTP host:port (default %(default)s)")
    parser.add_argument("--grpc", default=BurstConfig.grpc_url, help="gRPC host:port (default %(default)s)")
    parser.add_argument("--requests", type=int, default=BurstConfig.requests,
                        help="simultaneous requests (default %(default)s)")  # fmt: skip
    parser.add_argument("--max-tokens", type=int, default=BurstConfig.max_tokens,
                        help="max_tokens of each (default %(default)s)")  # fmt: skip
    parser.add_argument("--prefix-words", type=int, default=BurstConfig.prefix_words,
                        help="words in each shared prefix (default %(default)s)")  # fmt: skip
    parser.add_argument("--rounds", type=int, default=1, help="bursts one after another (default 1)")
    parser.add_argument("--server-pid", type=int, help="tritonserver's pid: report peak RSS of its processes")
    parser.add_argument("--json", type=Path, help="append each round's report to this JSON-lines file")
    args = parser.parse_args(argv)
    cfg = BurstConfig(http_url=args.http, grpc_url=args.grpc, requests=args.requests,
                      max_tokens=args.max_tokens, prefix_words=args.prefix_words)  # fmt: skip
    for round_ in range(args.rounds):
        report, _ = run_burst(cfg, args.server_pid)
        line = json.dumps({"round": round_, "config": asdict(cfg), **asdict(report)})
        print(line, flush=True)
        if args.json:
            with open(args.json, "a") as f:
                f.write(line + "\n")


if __name__ == "__main__":
    main()
