"""The whole stack as users run it, on this machine's device: one JSON of results.

    python -m preble_backend.benchmarks.gpu_stack --out DIR                 # KIND_GPU engines
    python -m preble_backend.benchmarks.gpu_stack --device cpu --out DIR    # the same steps on the CPU

``kernels/gpu_check.sh stack`` runs it on a lent GPU; the CPU run is its dry run (and a
test), so only what is GPU-specific is new on the device. The model is written here:
random weights with Llama-3-8B's layer shape (4 layers; the embedded tokenizer's vocabulary,
so every token decodes) on CUDA, a small shape on the CPU; fp32, so answers can be checked
token for token. Each step is recorded (``ok``, seconds, what it measured or its error)
and one failure leaves the others' results:

- ``reference``: the engine in this process, greedy, on prompts sharing a prefix;
- ``serve``: ``preble repo`` and ``preble serve`` (engines in servers of their own);
- ``grpc`` / ``openai``: the same prompts through Triton gRPC and the OpenAI front, each
  answer against the reference's;
- ``ttft``: time to first token through the router and from the engine's own server
  (sequential requests at low load; the difference is what the router adds);
- ``load``: 32 streams at once sharing the prefix: tokens/s and the prefix cache's hit ratio;
- ``nvml``: the GPU gauges the router exports (``preble_router_gpu_*``);
- ``perf_analyzer``: a short run where the binary is installed.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
import urllib.request
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch

from client.triton_client import PrebleClient, open_grpc, stream_infer
from preble_backend.benchmarks.attention_backends import Shape, write_model
from preble_backend.common.keys import ENGINE_KEY_ENV, grpc_bearer
from preble_backend.engine.config import EngineConfig
from preble_backend.engine.engine import Engine
from preble_backend.model.tiny_model import corpus, tiny_model_path
from preble_backend.runtime.access import new_key
from preble_backend.runtime.launcher import free_ports, wheel_root
from preble_backend.runtime.repository import write_repository
from preble_backend.serving.pbtxt import config_parameter

SHAPES = {  # hidden, (query heads, KV heads), MLP, layers; the vocabulary is the tokenizer's
    "cuda": (4096, (32, 8), 14336, 4),
    "cpu": (256, (8, 2), 512, 2),
}
MAX_TOKENS = 24
KV_TOKENS = 65536


def write_checkpoint(device: str, path: Path) -> Path:
    from transformers import AutoTokenizer

    tiny = tiny_model_path()
    vocab = len(AutoTokenizer.from_pretrained(tiny))
    hidden, heads, mlp, layers = SHAPES[device]
    write_model(Shape(hidden, heads, mlp, layers, vocab, 0, (0, 0), 0, 0, 0), str(path))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tiny / name, path / name)
    return path


def prompts(n: int = 8) -> list[str]:
    """``n`` prompts sharing a prefix of some hundreds of tokens, each with its own question."""
    lines = corpus(seed=7, num_lines=60 + n)
    shared = "\n".join(lines[:60])
    return [f"{shared}\n{line}\n" for line in lines[60:]]


def reference(model: Path, device: str, texts: list[str]) -> list[str]:
    """Greedy answers of the engine run in this process, decoded as the router decodes."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model)
    engine = Engine(
        EngineConfig(model_path=str(model), device=device, dtype="float32", max_num_tokens=KV_TOKENS)
    )
    out: dict[str, list[int]] = {}
    try:
        for i, text in enumerate(texts):
            out[str(i)] = []
            engine.add_request(str(i), tok(text).input_ids, {"max_tokens": MAX_TOKENS, "temperature": 0},
                               lambda o: out[o.request_id].extend(o.token_ids))  # fmt: skip
        while engine.has_work():
            engine.step()
    finally:
        engine.shutdown()
        del engine
        if device == "cuda":
            torch.cuda.empty_cache()
    return [tok.decode(out[str(i)], skip_special_tokens=True) for i in range(len(texts))]


class Stack:
    """``preble serve`` on free ports, its engines in servers of their own."""

    def __init__(self, repo: Path, out: Path) -> None:
        self.out, self.run_dir = out, None
        self.http, self.grpc, self.metrics, self.openai = free_ports(4)
        self.engine_key = new_key()
        env = {**os.environ, ENGINE_KEY_ENV: self.engine_key}
        ports = {"http": self.http, "grpc": self.grpc, "metrics": self.metrics, "openai": self.openai}
        flags = [a for name, port in ports.items() for a in (f"--{name}-port", str(port))]
        cmd = [sys.executable, "-m", "preble_backend.cli", "serve", "--model-repository", str(repo), *flags]
        pipe = {"stdout": subprocess.PIPE, "stderr": subprocess.STDOUT, "text": True}
        self.process = subprocess.Popen(cmd, env=env, **pipe)
        self.lines: list[str] = []
        try:
            for line in self.process.stdout:
                self.lines.append(line)
                if found := re.search(r"engine server\(s\) \(logs: (\S+)\)", line):
                    self.run_dir = Path(found.group(1))  # its logs, and the router's repository
                if line.startswith("ready"):
                    break
            else:
                raise RuntimeError("preble serve ended: " + "".join(self.lines[-20:]))
            router = (self.run_dir / "router" / "preble" / "config.pbtxt").read_text()
            engine = config_parameter(router, "engines").split(",")[0]
            self.engine_url, self.engine_model = engine.split("=grpc://", 1)[1].split("/", 1)
        except BaseException:
            self.stop()
            raise

    def stop(self) -> None:
        """Keep the servers' logs (``preble serve`` removes its directory on the way out), then stop."""
        for log in self.run_dir.glob("*.log") if self.run_dir else ():
            shutil.copy(log, self.out / log.name)
        self.process.send_signal(signal.SIGTERM)
        self.process.wait(120)


def first_token_s(url: str, model: str, key: str | None, inputs: dict[str, np.ndarray]) -> float:
    channel, stub = open_grpc(url)
    try:
        start = time.perf_counter()
        for outputs, final in stream_infer(stub, model, inputs, 120, metadata=grpc_bearer(key)):
            if outputs:
                return time.perf_counter() - start
            if final:
                break
        raise RuntimeError("no token came back")
    finally:
        channel.close()


def ttft(stack: Stack, text: str, model: Path, rounds: int = 12) -> dict:
    """Median time to first token of the same prompt (its prefix cached) through the router
    and from the engine's own server, alternating, one request at a time."""
    from transformers import AutoTokenizer

    params = np.array([json.dumps({"max_tokens": 2, "temperature": 0}).encode()], dtype=np.object_)
    routed = {"text_input": np.array([text.encode()], dtype=np.object_), "stream": np.array([True]),
              "sampling_parameters": params}  # fmt: skip
    ids = np.array(AutoTokenizer.from_pretrained(model)(text).input_ids, dtype=np.int32)
    direct = {"input_ids": ids, "sampling_parameters": params}
    times: dict[str, list[float]] = {"router": [], "engine": []}
    for _ in range(rounds):
        times["router"].append(first_token_s(f"127.0.0.1:{stack.grpc}", "preble", None, routed))
        times["engine"].append(first_token_s(stack.engine_url, stack.engine_model, stack.engine_key, direct))
    med = {k: statistics.median(v[2:]) * 1e3 for k, v in times.items()}  # the first two warm up
    return {
        "router_ms": med["router"],
        "engine_ms": med["engine"],
        "router_adds_ms": med["router"] - med["engine"],
    }


def metric_lines(stack: Stack, prefix: str) -> dict[str, float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{stack.metrics}/metrics", timeout=10) as r:
        lines = r.read().decode().splitlines()
    return {ln.rsplit(" ", 1)[0]: float(ln.rsplit(" ", 1)[1]) for ln in lines if ln.startswith(prefix)}


def load(stack: Stack, texts: list[str]) -> dict:
    client = PrebleClient(grpc_url=f"127.0.0.1:{stack.grpc}")
    before = metric_lines(stack, "preble_router_")
    start = time.perf_counter()
    with ThreadPoolExecutor(32) as pool:
        results = list(pool.map(lambda t: client.stream_grpc(t, {"max_tokens": 64, "temperature": 0}), texts))
    wall = time.perf_counter() - start
    after = metric_lines(stack, "preble_router_")

    def grew(name: str) -> float:
        return sum(v - before.get(k, 0.0) for k, v in after.items() if k.startswith(name))

    tokens = sum(len(r.responses) for r in results)  # one streamed response per token
    cached = grew("preble_router_cached_prompt_tokens_total")
    prompt = grew("preble_router_prompt_tokens_total")
    return {"requests": len(texts), "wall_s": wall, "responses_per_s": tokens / wall,
            "hit_ratio": cached / max(1.0, prompt)}  # fmt: skip


def openai_answers(stack: Stack, texts: list[str]) -> list[str]:
    base = f"http://127.0.0.1:{stack.openai}/v1"
    with urllib.request.urlopen(f"{base}/models", timeout=30) as r:
        model = json.loads(r.read())["data"][0]["id"]
    answers = []
    for text in texts:
        body = json.dumps(
            {"model": model, "prompt": text, "max_tokens": MAX_TOKENS, "temperature": 0}
        ).encode()
        request = urllib.request.Request(f"{base}/completions", body, {"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=300) as r:
            answers.append(json.loads(r.read())["choices"][0]["text"])
    return answers


def compare(answers: list[str], expected: list[str]) -> dict:
    same = [a == e for a, e in zip(answers, expected)]
    diff = [{"got": a, "expected": e} for a, e in zip(answers, expected) if a != e][:2]
    return {"identical": all(same) and any(expected), "identical_count": sum(same), "of": len(same),
            "answer_chars": [len(e) for e in expected], "first_differences": diff}  # fmt: skip


def has_perf_analyzer() -> bool:
    from client.perf_analyzer import perf_analyzer_binary

    try:
        return bool(perf_analyzer_binary())
    except FileNotFoundError:
        return False


def perf_analyzer(stack: Stack) -> dict:
    from client.perf_analyzer import run

    done = run(f"127.0.0.1:{stack.grpc}", concurrency=4, request_count=32, max_tokens=16, timeout=240)
    tail = [
        ln.strip() for ln in done.stdout.splitlines() if "throughput" in ln.lower() or "latency" in ln.lower()
    ]
    return {"returncode": done.returncode, "summary": tail[-6:], "stderr": done.stderr[-400:]}


def graph_capture(out: Path) -> str:
    """Whether the engine inside tritonserver captured its decode graphs: a failed capture
    leaves it serving eagerly, and only its log says so."""
    for log in sorted(out.glob("*.log")):
        for line in log.read_text(errors="replace").splitlines():
            if "capturing its CUDA graphs failed" in line:
                return f"capture failed ({log.name}): {line.strip()[-400:]}"
    return "no capture failure logged"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--out", default="gpu-out/stack")
    args = ap.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results: dict = {"device": args.device, "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
                     "python": platform.python_version(), "torch": torch.__version__,
                     "steps": {}}  # fmt: skip
    if args.device == "cuda":
        results["gpu"] = torch.cuda.get_device_name(0)
    results["tritonserver"] = str(wheel_root())
    work = Path(tempfile.mkdtemp(prefix="preble-stack-"))
    state: dict = {}

    def step(name: str, fn: Callable[[], dict | None]) -> bool:
        start = time.perf_counter()
        try:
            found = fn() or {}
            results["steps"][name] = {"ok": True, "s": round(time.perf_counter() - start, 2), **found}
        except Exception as exc:
            results["steps"][name] = {"ok": False, "s": round(time.perf_counter() - start, 2),
                                      "error": f"{type(exc).__name__}: {exc}"[-2000:],
                                      "trace": traceback.format_exc()[-2000:]}  # fmt: skip
        print(f"{name}: {results['steps'][name]}", flush=True)
        (out / "stack.json").write_text(json.dumps(results, indent=1))
        return results["steps"][name]["ok"]

    texts = prompts()
    step("model", lambda: {"path": str(write_checkpoint(args.device, work / "model"))})
    step("reference", lambda: state.update(expected=reference(work / "model", args.device, texts)))

    def serve() -> dict:
        gpus = [0] if args.device == "cuda" else None
        repo = write_repository(work / "repo", model_path=str(work / "model"), gpus=gpus, cpu_engines=1,
                                dtype="float32", max_num_tokens=KV_TOKENS)  # fmt: skip
        state["stack"] = Stack(repo, out)
        return {"engine": state["stack"].engine_model}

    if step("serve", serve):
        stack = state["stack"]
        try:
            client = PrebleClient(grpc_url=f"127.0.0.1:{stack.grpc}")
            expected = state.get("expected", [])
            greedy = {"max_tokens": MAX_TOKENS, "temperature": 0}
            step("grpc", lambda: compare([client.stream_grpc(t, greedy).text for t in texts], expected))
            step("openai", lambda: compare(openai_answers(stack, texts), expected))
            step("ttft", lambda: ttft(stack, texts[0], work / "model"))
            step("load", lambda: load(stack, prompts(32)))
            step("nvml", lambda: {"gauges": metric_lines(stack, "preble_router_gpu_")})
            if has_perf_analyzer():
                step("perf_analyzer", lambda: perf_analyzer(stack))
        finally:
            stack.stop()
            shutil.copytree(work / "repo", out / "repo", dirs_exist_ok=True)
            results["decode_graphs"] = graph_capture(out)
            (out / "stack.json").write_text(json.dumps(results, indent=1))
    shutil.rmtree(work, ignore_errors=True)
    failed = [name for name, s in results["steps"].items() if not s["ok"]]
    print(f"stack: {len(results['steps']) - len(failed)} steps ok; failed: {', '.join(failed) or 'none'}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
