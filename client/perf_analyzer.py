"""Load-test the ``preble`` router with perf_analyzer over gRPC streaming.

Writes an ``--input-data`` file from a workload generator, then runs perf_analyzer (from
``tritonclient[all]==2.51.0``) with ``-i grpc --streaming``. The binary needs
``libcudart.so.12`` (the ``nvidia-cuda-runtime-cu12`` wheel) and ``libb64.so.0d``, which
the ``nvidia-pytriton`` wheel carries under a mangled name; both are put on
``LD_LIBRARY_PATH`` here, so nothing needs installing system-wide. Usage:

    python -m client.perf_analyzer --url 127.0.0.1:8001 --concurrency 4 --request-count 64
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import site
import subprocess
import sys
import tempfile
from pathlib import Path

from client.workloads import WORKLOADS, Materializer, generate


def write_input_data(
    path: Path, workload: str, num_prompts: int, max_tokens: int, seed: int = 0, scale: float = 0.1
) -> Path:
    """Prompts as text (``scale`` shrinks the paper's lengths to fit small models);
    every request asks for ``max_tokens`` with EOS ignored, so load is predictable."""
    words = Materializer()
    data = [
        {
            "text_input": [words.text(r)],
            "stream": [True],
            "exclude_input_in_output": [True],
            "sampling_parameters": [json.dumps({"max_tokens": max_tokens, "ignore_eos": True})],
        }
        for r in generate(workload, num_prompts, seed=seed, scale=scale)
    ]
    path.write_text(json.dumps({"data": data}))
    return path


def perf_analyzer_env(libdir: Path) -> dict[str, str]:
    """LD_LIBRARY_PATH with libcudart.so.12 and a ``libb64.so.0d`` link in ``libdir``."""
    dirs = [str(libdir)]
    for sp in site.getsitepackages():
        cudart = Path(sp) / "nvidia" / "cuda_runtime" / "lib"
        if (cudart / "libcudart.so.12").exists():
            dirs.append(str(cudart))
        for b64 in (Path(sp) / "nvidia_pytriton.libs").glob("libb64-*.so.0d"):
            link = libdir / "libb64.so.0d"
            if not link.exists():
                link.symlink_to(b64)
    env = dict(os.environ)
    env["LD_LIBRARY_PATH"] = os.pathsep.join([*dirs, env.get("LD_LIBRARY_PATH", "")])
    return env


def perf_analyzer_binary() -> str:
    path = Path(sys.executable).parent / "perf_analyzer"
    found = str(path) if path.exists() else shutil.which("perf_analyzer")
    if not found:
        raise FileNotFoundError("perf_analyzer not found: install tritonclient[all]==2.51.0")
    return found


def run(
    url: str,
    concurrency: int,
    request_count: int,
    workload: str = "toolbench",
    num_prompts: int = 32,
    max_tokens: int = 16,
    model: str = "preble",
    extra: list[str] | None = None,
    timeout: float = 900,
) -> subprocess.CompletedProcess:
    with tempfile.TemporaryDirectory(prefix="preble-pa-") as tmp:
        data = write_input_data(Path(tmp) / "input.json", workload, num_prompts, max_tokens)
        cmd = [
            perf_analyzer_binary(),
            "-m",
            model,
            "-u",
            url,
            "-i",
            "grpc",
            "--streaming",
            "--input-data",
            str(data),
            "--concurrency-range",
            str(concurrency),
            "--measurement-mode",
            "count_windows",
            "--measurement-request-count",
            str(request_count),
            "--request-count",
            str(request_count),
            *(extra or []),
        ]
        return subprocess.run(
            cmd, env=perf_analyzer_env(Path(tmp)), capture_output=True, text=True, timeout=timeout
        )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", default="127.0.0.1:8001", help="gRPC endpoint")
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--request-count", type=int, default=64)
    parser.add_argument("--workload", default="toolbench", choices=sorted(WORKLOADS))
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=16)
    args, extra = parser.parse_known_args(argv)
    result = run(
        args.url,
        args.concurrency,
        args.request_count,
        args.workload,
        args.num_prompts,
        args.max_tokens,
        extra=extra,
    )
    print(result.stdout)
    print(result.stderr, file=sys.stderr)
    return result.returncode


if __name__ == "__main__":
    sys.exit(main())
