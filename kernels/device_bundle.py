"""What a lent GPU machine lacks to serve the stack, built here into ``.device/`` and carried.

    python -m kernels.device_bundle            # writes .device/, prints its size against the limit

The device image has PyTorch, Triton, numpy, grpcio, protobuf and nvidia-ml-py but no
tritonserver and none of the front's packages, and nothing can be fetched there
(``/work/.library/device/KINDS.md``, read 2026-11-17). So this writes:

- ``.device/site.tar.xz``: the ``nvidia-pytriton`` wheel's server as this environment has
  it installed (the ``pytriton`` package and its bundled libraries), with the Python
  backend stub of the device's Python only and without the libpython the wheel bundles
  for another version's stub (a third of its size);
- ``.device/packages.tar.xz``: the packages below, at the versions installed here,
  installed for the device's Python (``pip install --target`` with its platform tags;
  ``tritonclient``'s manylinux wheel carries ``perf_analyzer``), without tests, bytecode
  or ``perf_client`` (a second copy of ``perf_analyzer``): 19.3 MiB, numpy 1 included,
  where the wheels without numpy took 24.6;
- ``.device/flashinfer.tar.xz``: FlashInfer, the kernels' comparison point, the same way
  (``FLASHINFER``), so the ratio columns come from the call that serves the stack.

Before building, every requirement of what travels, and of the project, for the device's
Python must travel too or be on the image at a version it allows (``unmet_requirements``,
against the image's package list in ``DEVICE_IMAGE`` and the versions in
``DEVICE_VERSIONS``). ``kernels/gpu_check.sh`` unpacks both archives into ``/tmp/site`` on
the device. A device call carries at most 64 MiB in all, the repository's tracked files
included: the total is printed and checked.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

DEVICE_PYTHON = "3.12"  # python3 of the device image (KINDS.md)
LACKING = [  # what the front, the router's client and the benchmarks import that the image lacks
    "tritonclient", "fastapi", "starlette", "pydantic", "pydantic-core", "annotated-types",
    "typing-inspection", "uvicorn", "llguidance", "nvidia-cuda-runtime-cu12",
    "python-rapidjson", "protobuf",  # tritonclient.grpc's JSON, and the protobuf its stubs were built for
    "opentelemetry-api",  # fastapi imports it
    # The image's numpy 2.5.2 shadowed: Triton 2.51's Python backend stub (pybind11 < 2.12)
    # reads numpy 2's dtype at numpy 1's offsets, so every tensor reached the models as its
    # first byte repeated and both stubs crashed on their first request (second H200 session).
    "numpy",
]  # fmt: skip
# The device image's packages (KINDS.md, "Python packages already there", read 2026-11-17):
# where LACKING's requirements may come from without travelling.
DEVICE_IMAGE = frozenset(
    """
    absl-py accelerate aiofiles aiohappyeyeballs aiohttp aiosignal annotated-doc anyio attrs botorch
    build certifi charset-normalizer chex click cloudpickle cmake colorama contourpy coverage
    cuda-bindings cuda-core cuda-pathfinder cuda-toolkit cupy-cuda13x cycler cython diffrax e3nn
    einops equinox etils execnet filelock flatbuffers flax fonttools formulaic frozenlist fsspec
    gpytorch grpcio h11 h5py hf-xet httpcore httpx huggingface-hub humanize hypothesis idna imageio
    iniconfig interface-meta jax jax-cuda13-pjrt jax-cuda13-plugin jaxlib jaxtyping jinja2 joblib
    kiwisolver lazy-loader lightning lightning-utilities linear-operator lineax llvmlite lxml
    markdown markdown-it-py markupsafe matplotlib mdurl meson ml-dtypes mpi4py mpmath msgpack
    multidict multipledispatch mypy-extensions nanobind narwhals networkx ninja numba numba-cuda
    numpy numpyro nvidia-cublas nvidia-cuda-cupti nvidia-cuda-nvrtc nvidia-cuda-runtime
    nvidia-cudnn-cu13 nvidia-cufft nvidia-cufile nvidia-curand nvidia-cusolver nvidia-cusparse
    nvidia-cusparselt-cu13 nvidia-ml-py nvidia-nccl-cu13 nvidia-nvjitlink nvidia-nvshmem-cu13
    nvidia-nvtx onnx onnx-ir onnxruntime onnxscript opencv-python-headless opt-einsum opt-einsum-fx
    optax optimistix orbax-checkpoint packaging pandas pathspec patsy peft pillow pip pluggy
    portalocker prometheus-client propcache protobuf psutil py-cpuinfo pyarrow pybind11 pygments
    pyparsing pyproject-hooks pyre-extensions pytest pytest-benchmark pytest-cov pytest-mock
    pytest-timeout pytest-xdist python-dateutil pytorch-lightning pyyaml regex requests rich
    sacrebleu safetensors scikit-build-core scikit-image scikit-learn scipy seaborn
    sentence-transformers sentencepiece setuptools shellingham simplejson six sortedcontainers
    statsmodels sympy tabulate tensorboard tensorboard-data-server tensorstore threadpoolctl
    tifffile tiktoken timm tokenizers toolz torch torch-geometric torchaudio torchdiffeq
    torchmetrics torchvision tqdm transformers treescope triton typer typing-extensions
    typing-inspect urllib3 uvloop wadler-lindig werkzeug wheel wrapt xarray xxhash yarl zipp
    """.split()
)
# Versions on the image (KINDS.md's pip list, 2026-11), for the requirements it meets by name.
DEVICE_VERSIONS = {"numpy": "2.5.2", "torch": "2.11.0", "transformers": "5.17.0", "triton": "3.6.0",
                   "tokenizers": "0.23.2", "safetensors": "0.8.0"}  # fmt: skip
# FlashInfer is not installed here (no GPU): pinned. Its wheel carries its CUDA sources and
# CUTLASS headers and compiles the paged kernels on the device at first use; what it
# requires beyond the image (nvidia-cudnn-frontend, nvidia-cutlass-dsl: 11 MiB and more)
# serves other kernels, and 0.5.3 imports without them (the rehearsal checks the import).
FLASHINFER = ["flashinfer-python==0.5.3", "apache-tvm-ffi==0.1.15.post2"]
USED_EXTRAS = {"tritonclient": ("grpc",)}  # the project imports tritonclient.grpc only
# The project's own requirements that need not travel as wheels, and why.
NOT_AS_WHEELS = {
    "nvidia-pytriton": "its server travels as site.tar.xz",
    "gguf": "only `preble model` imports it",
}
PROJECT = "preble-triton"
# the newest is nvidia-pytriton's own (glibc 2.35): the device runs that wheel's server already
PLATFORMS = [f"manylinux_2_{v}_x86_64" for v in (35, 34, 31, 28, 17)] + ["manylinux2014_x86_64"]
CARRY_LIMIT = 64 << 20
# The repository's share: the archives took 49.8 MiB on 2026-11-29, so 10 MiB of tracked
# files leaves 4 MiB for them to grow (the simulator's records, kept compressed, were once
# 11.4 MiB of 13.9 tracked and crowded FlashInfer out).
TRACKED_BUDGET = 10 << 20


def server_archive(out: Path, python: str = DEVICE_PYTHON, preset: int = 6) -> Path:
    """The installed ``nvidia-pytriton`` server, trimmed to ``python``'s stub, as tar.xz
    (``preset``: xz's, 0 fast and 9 small)."""
    import importlib.util

    spec = importlib.util.find_spec("pytriton")
    if spec is None:
        raise SystemExit("nvidia-pytriton is not installed here: pip install nvidia-pytriton")
    package = Path(next(iter(spec.submodule_search_locations)))
    libs = package.parent / "nvidia_pytriton.libs"
    stubs = package / "tritonserver" / "python_backend_stubs"
    if not (stubs / python / "triton_python_backend_stub").is_file():
        raise SystemExit(f"nvidia-pytriton ships no Python backend stub for Python {python}")

    def keep(info: tarfile.TarInfo) -> tarfile.TarInfo | None:
        parts = Path(info.name).parts
        if "__pycache__" in parts or Path(info.name).name.startswith("libpython3"):
            return None
        if len(parts) > 3 and parts[1:3] == ("tritonserver", "python_backend_stubs") and parts[3] != python:
            return None
        return info

    path = out / "site.tar.xz"
    with tarfile.open(path, "w:xz", preset=preset) as tar:
        tar.add(package, arcname="pytriton", filter=keep)
        tar.add(libs, arcname="nvidia_pytriton.libs", filter=keep)
    return path


def packages_archive(
    out: Path,
    python: str = DEVICE_PYTHON,
    preset: int = 6,
    pins: list[str] | None = None,
    name: str = "packages.tar.xz",
) -> Path:
    """``pins`` (``LACKING`` at the versions installed here) installed for the device's
    Python into a folder that becomes ``name`` (unpacked into the device's ``/tmp/site``)."""
    pins = pins or [f"{n}=={importlib.metadata.version(n)}" for n in LACKING]
    platforms = [f"--platform={p}" for p in PLATFORMS]
    with tempfile.TemporaryDirectory() as target:
        cmd = [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-compile",
               "--only-binary=:all:", "--implementation=cp", "--python-version", python,
               "--target", target, *platforms, *pins]  # fmt: skip
        subprocess.run(cmd, check=True)

        def keep(info: tarfile.TarInfo) -> tarfile.TarInfo | None:
            parts = Path(info.name).parts
            if {"__pycache__", "tests"} & set(parts) or parts[-2:] == ("bin", "perf_client"):
                return None
            return info

        path = out / name
        with tarfile.open(path, "w:xz", preset=preset) as tar:
            for item in sorted(Path(target).iterdir()):
                tar.add(item, arcname=item.name, filter=keep)
    return path


def archives(out: Path, python: str = DEVICE_PYTHON, preset: int = 6) -> list[Path]:
    """Everything ``.device/`` holds, built into ``out``."""
    flashinfer = packages_archive(out, python, preset, pins=FLASHINFER, name="flashinfer.tar.xz")
    return [server_archive(out, python, preset), packages_archive(out, python, preset), flashinfer]


def unmet_requirements(
    lacking: list[str] = LACKING,
    image: frozenset[str] = DEVICE_IMAGE,
    versions: dict[str, str] = DEVICE_VERSIONS,
) -> dict[str, list[str]]:
    """For each package that travels, and for the project itself, its requirements for the
    device's Python (with the extras the project uses) that neither travel nor are on the
    image at a version they allow: each is an import that fails, or misbehaves, there. (The
    first lent H200 lacked ``python-rapidjson``, which ``tritonclient.grpc`` imports: the
    router could not load; the second had numpy 2, which the stubs misread.)"""
    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name

    carried = {canonicalize_name(n) for n in lacking}
    have = carried | {canonicalize_name(n) for n in image}
    device = {"python_version": DEVICE_PYTHON, "sys_platform": "linux", "platform_system": "Linux",
              "platform_machine": "x86_64"}  # fmt: skip
    unmet: dict[str, set[str]] = {}
    for name in (*lacking, PROJECT):
        for text in importlib.metadata.requires(name) or []:
            req = Requirement(text)
            extras = ("", *USED_EXTRAS.get(name, ()))
            if req.marker and not any(req.marker.evaluate({**device, "extra": e}) for e in extras):
                continue
            if name == PROJECT and req.name in NOT_AS_WHEELS:
                continue
            needed = canonicalize_name(req.name)
            on_image = None if needed in carried else versions.get(needed)
            if needed not in have or (on_image and not req.specifier.contains(on_image, prereleases=True)):
                unmet.setdefault(name, set()).add(req.name)
    return {name: sorted(missing) for name, missing in unmet.items()}


def tracked_bytes(root: Path) -> int:
    """What a device call copies of the repository: its tracked files."""
    names = subprocess.run(["git", "ls-files", "-z"], cwd=root, capture_output=True, check=True).stdout
    return sum((root / n).stat().st_size for n in names.decode().split("\0") if n and (root / n).is_file())


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=".device")
    ap.add_argument("--python", default=DEVICE_PYTHON, help="the Python whose stub and wheels travel")
    args = ap.parse_args(argv)
    if unmet := unmet_requirements():
        print(f"not on the device image and not carried: {unmet} (add them to LACKING)", file=sys.stderr)
        return 1
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    files = archives(out, args.python)
    sizes = {str(f.relative_to(out)): f.stat().st_size for f in files}
    repo = tracked_bytes(Path.cwd())
    total = repo + sum(sizes.values())
    manifest = {"python": args.python, "files": sizes, "repository_bytes": repo, "total_bytes": total,
                "limit_bytes": CARRY_LIMIT}  # fmt: skip
    (out / "manifest.json").write_text(json.dumps(manifest, indent=1))
    for name, size in sizes.items():
        print(f"{size / 2**20:8.1f} MiB  {name}")
    print(f"{repo / 2**20:8.1f} MiB  the repository's tracked files")
    print(f"{total / 2**20:8.1f} MiB  in all (a device call carries at most {CARRY_LIMIT >> 20} MiB)")
    return 0 if total <= CARRY_LIMIT else 1


if __name__ == "__main__":
    sys.exit(main())
