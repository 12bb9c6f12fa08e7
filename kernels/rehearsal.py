"""The device's environment rehearsed on this CPU machine, before any device minute.

    python -m kernels.rehearsal            # make rehearsal: builds .rehearsal/venv once, then runs

Two lent GPU sessions were lost to the environment, not the code: the Python backend stub
ignored ``PYTHONPATH`` (where the device unpacks what its image lacks), and Triton 2.51's
stub misread the image's numpy 2. Neither shows in this project's own virtual environment,
which has numpy 1 and every package installed. So this builds a second one with the device
image's versions (``image_pins``: torch, triton, transformers, numpy 2, ...) and none of the
packages the image lacks (``device_bundle.LACKING``, numpy apart), copies the work tree as a
device call does, builds ``.device/`` into it for this Python, and runs
``kernels/gpu_check.sh stack tests`` there with ``DEVICE=cpu``: the device's script, from the
unpacked bundle, with a CPU engine, then the kernels' tests under the image's Triton (its
interpreter, here).

What differs from the device: the Python is this machine's (3.11; the image's 3.12 cannot be
installed here), so the stub is 3.11's and numpy is the newest 2.x for it (2.4.6, where the
image has 2.5.2); torch is PyPI's CUDA build of the image's version, on no GPU.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from kernels.device_bundle import DEVICE_VERSIONS, LACKING, archives, unmet_requirements

ROOT = Path(__file__).resolve().parents[1]
VENV = ROOT / ".rehearsal" / "venv"
# What the project imports that the image has, beyond DEVICE_VERSIONS (at the image's
# version where KINDS.md gives one; the rest at PyPI's newest, as the image's are recent).
ALSO_ON_IMAGE = {"huggingface-hub": "1.33.0", "accelerate": "1.15.0", "grpcio": "", "nvidia-ml-py": "",
                 "matplotlib": "", "tqdm": "", "aiohttp": "", "pyyaml": "", "requests": "",
                 "packaging": "", "pytest": "", "hypothesis": ""}  # fmt: skip
# numpy 2.5 needs Python 3.12: elsewhere the newest 2.x stands in for the image's
NUMPY_BEFORE_312 = "numpy>=2,<2.5"


class Unavailable(RuntimeError):
    """The image's versions cannot be installed here (no index, another platform)."""


def image_pins(python: tuple[int, int]) -> list[str]:
    pins = {**DEVICE_VERSIONS, **ALSO_ON_IMAGE}
    specs = [f"{name}=={v}" if v else name for name, v in pins.items() if name != "numpy"]
    return [*specs, f"numpy=={pins['numpy']}" if python >= (3, 12) else NUMPY_BEFORE_312]


def venv_python(venv: Path = VENV) -> Path:
    """The rehearsal's interpreter, built once (``.installed`` records the pins it holds)."""
    python = venv / "bin" / "python3"
    pins = image_pins(sys.version_info[:2])
    marker = venv / ".installed"
    if marker.is_file() and marker.read_text().split() == pins:
        return python
    shutil.rmtree(venv, ignore_errors=True)
    base = getattr(sys, "_base_executable", sys.executable)
    steps = [[base, "-m", "venv", str(venv)],
             [str(python), "-m", "pip", "install", "-q", "--disable-pip-version-check", *pins]]  # fmt: skip
    for cmd in steps:
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode != 0:
            raise Unavailable(f"{' '.join(cmd[:4])} ...: {done.stderr.strip()[-600:]}")
    # what a newer release pulls in that the image lacks (typer's pydantic, say) goes again
    if lacking := sorted(lacking_here(installed(python))):
        subprocess.run([str(python), "-m", "pip", "uninstall", "-q", "-y", *lacking], check=True)
    marker.write_text("\n".join(pins))
    return python


def installed(python: Path) -> dict[str, str]:
    """Every distribution in ``python``'s environment, by canonical name."""
    code = ("import importlib.metadata as m, json, re; print(json.dumps({re.sub(r'[-_.]+', '-', "
            "d.metadata['Name']).lower(): d.version for d in m.distributions()}))")  # fmt: skip
    return json.loads(
        subprocess.run([str(python), "-c", code], capture_output=True, text=True, check=True).stdout
    )


def check_image(have: dict[str, str]) -> list[str]:
    """How the environment differs from the image in what matters: a pinned version that
    is not the image's, or a package the image lacks (numpy apart: the image has 2.x)."""
    wrong = [f"{n} {have.get(n)} (the image: {v})" for n, v in DEVICE_VERSIONS.items()
             if n != "numpy" and have.get(n) != v]  # fmt: skip
    if not have.get("numpy", "0").startswith("2."):
        wrong.append(f"numpy {have.get('numpy')} (the image: {DEVICE_VERSIONS['numpy']})")
    return wrong + [f"{n} is installed (the image lacks it)" for n in sorted(lacking_here(have))]


def lacking_here(have: dict[str, str]) -> set[str]:
    """What is installed of what the image lacks (numpy apart: the image has 2.x)."""
    return ({n.lower() for n in LACKING} - {"numpy"}) & have.keys()


def work_tree(dest: Path) -> Path:
    """The files a device call copies: tracked ones, and untracked ones git does not ignore."""
    names = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                           cwd=ROOT, capture_output=True, check=True).stdout.decode().split("\0")  # fmt: skip
    for name in filter(None, names):
        if (ROOT / name).is_file():
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, dest / name)
    return dest


def rehearse(
    out: Path, venv: Path = VENV, steps: tuple[str, ...] = ("stack", "tests"), timeout: float = 1500
) -> dict:
    """Run the device script's ``steps`` here (``tests``: the kernels under the image's
    Triton, in its interpreter); returns ``stack.json`` with the script's exit code, its
    summary and how the environment stands against the image."""
    python = venv_python(venv)
    have = installed(python)
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    with tempfile.TemporaryDirectory(prefix="preble-rehearsal-") as tmp:
        work = work_tree(Path(tmp) / "work")
        (work / ".device").mkdir()
        archives(work / ".device", version, preset=0)
        path = [
            str(python.parent),
            *(p for p in os.environ["PATH"].split(os.pathsep) if not p.startswith(str(ROOT))),
        ]
        env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
        env.update(PATH=os.pathsep.join(path), DEVICE="cpu", SITE=str(Path(tmp) / "site"), CHECK_DIR=str(out))
        out.mkdir(parents=True, exist_ok=True)
        script = ["bash", "kernels/gpu_check.sh", " ".join(steps)]
        done = subprocess.run(script, cwd=work, env=env, capture_output=True, text=True, timeout=timeout)
        (out / "gpu_check.log").write_text(done.stdout + done.stderr)  # each step's own log is beside it
        stack = out / "stack" / "stack.json"
        results = json.loads(stack.read_text()) if stack.is_file() else {"steps": {}}
        results["tritonserver"] = results.get("tritonserver", "").replace(tmp, "$REHEARSAL")
    summary, machine = (out / "summary.txt", out / "machine.txt")
    summary, machine = (f.read_text().strip() if f.is_file() else "" for f in (summary, machine))
    ran = dict(line.split(": ", 1) for line in summary.splitlines())  # "stack: exit 0 in 29 s"
    failed = [name for name in steps if not ran.get(name, "").startswith("exit 0 ")]
    versions = {n: have.get(n) for n in (*DEVICE_VERSIONS, "numpy")}
    return {**results, "failed_steps": failed, "summary": summary, "machine": machine, "versions": versions,
            "differs_from_image": check_image(have), "unmet_requirements": unmet_requirements()}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="gpu-out/rehearsal")
    ap.add_argument("--venv", default=str(VENV))
    ap.add_argument("--steps", default="stack tests", help="gpu_check.sh's steps to run (stack, tests)")
    args = ap.parse_args(argv)
    try:
        results = rehearse(Path(args.out).resolve(), Path(args.venv), tuple(args.steps.split()))
    except Unavailable as exc:
        print(f"the device image's versions cannot be installed here: {exc}", file=sys.stderr)
        return 2
    steps = results["steps"]
    for name, step in steps.items():
        print(f"{name:14s} {'ok' if step['ok'] else 'FAILED'}  {step.get('error', '')[:300]}")
    print(f"versions: {results['versions']}")
    print(f"differs from the image: {results['differs_from_image'] or 'nothing'}")
    print(f"not on the image and not carried: {results['unmet_requirements'] or 'nothing'}")
    print(results["machine"])
    print(results["summary"])
    ok = not results["failed_steps"] and steps and all(s["ok"] for s in steps.values())
    ok = ok and not results["differs_from_image"] and not results["unmet_requirements"]
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
