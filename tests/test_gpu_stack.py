"""The device script's stack step, dry-run on the CPU: the server the device will get from
``.device/`` (the wheel's, trimmed by ``kernels.device_bundle``) serves the whole stack, and
every answer through Triton gRPC and the OpenAI front is the in-process engine's."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

from kernels.device_bundle import server_archive

PYTHON = f"{sys.version_info.major}.{sys.version_info.minor}"


def test_the_server_archive_keeps_one_stub_and_no_bundled_libpython(tmp_path):
    with tarfile.open(server_archive(tmp_path, PYTHON, preset=0)) as tar:
        names = tar.getnames()
    stubs = {n.split("/")[3] for n in names if "/python_backend_stubs/" in n and n.count("/") >= 3}
    assert stubs == {PYTHON}
    assert "pytriton/tritonserver/bin/tritonserver" in names
    assert any(n.startswith("nvidia_pytriton.libs/libtritonserver") for n in names)
    assert not [n for n in names if Path(n).name.startswith("libpython3") or "__pycache__" in n]


def test_the_tracked_files_leave_the_bundle_its_room():
    """A device call carries the repository's tracked files beside ``.device/``: they stay
    under their budget, and the simulator's records stay compressed (JSON gzipped, plots
    in 256 colours), as ``scheduler/sim/sweep.py`` and ``client/plots.py`` write them."""
    from PIL import Image

    from kernels.device_bundle import TRACKED_BUDGET, tracked_bytes

    root = Path(__file__).resolve().parents[1]
    assert tracked_bytes(root) <= TRACKED_BUDGET
    names = subprocess.run(
        ["git", "ls-files", "docs/sim"], cwd=root, capture_output=True, text=True
    ).stdout.split()
    assert names and not [n for n in names if n.endswith(".json")]
    assert not [n for n in names if n.endswith(".png") and Image.open(root / n).mode != "P"]


def test_every_requirement_of_what_travels_is_carried_or_on_the_device_image():
    """The first lent H200 lacked ``python-rapidjson`` (``tritonclient.grpc`` imports it) and
    would have lacked ``opentelemetry-api`` (``fastapi`` imports it): the bundle now checks
    the requirements of what it carries, and of the project, before building."""
    from kernels.device_bundle import LACKING, unmet_requirements

    assert unmet_requirements() == {}
    without = [n for n in LACKING if n not in ("python-rapidjson", "opentelemetry-api", "pydantic-core")]
    assert unmet_requirements(without) == {
        "tritonclient": ["python-rapidjson"], "fastapi": ["opentelemetry-api"], "pydantic": ["pydantic-core"]
    }  # fmt: skip


def test_a_requirement_the_image_meets_only_by_name_travels():
    """The second lent H200 had numpy 2.5.2 where the project asks for numpy<2: the bundle
    carries numpy 1, and without it the check names numpy (torch's and transformers' image
    versions meet the project's bounds; tritonclient 2.51 asks for numpy<2 too)."""
    from kernels.device_bundle import LACKING, unmet_requirements

    without = [n for n in LACKING if n != "numpy"]
    assert unmet_requirements(without) == {"tritonclient": ["numpy"], "preble-triton": ["numpy"]}
    assert unmet_requirements(versions={"numpy": "2.5.2", "torch": "1.0.0"}) == {"preble-triton": ["torch"]}


def test_the_wheels_stub_is_never_started_beside_numpy_2(tmp_path, monkeypatch):
    """Triton 2.51's stub misreads numpy 2 arrays (every tensor its first byte repeated):
    the launcher refuses, naming numpy, before any server starts."""
    import numpy

    from preble_backend.runtime.launcher import LaunchError, start_server, wheel_root

    if wheel_root() is None:
        pytest.skip("nvidia-pytriton's server is not installed here")
    (tmp_path / "repo").mkdir()
    monkeypatch.setattr(numpy, "__version__", "2.5.2")
    with pytest.raises(LaunchError, match=r"numpy 2\.5\.2 .*install numpy<2"):
        start_server(tmp_path / "repo")


@pytest.mark.server
def test_the_stack_step_dry_run_on_the_cpu_from_the_trimmed_server(tmp_path):
    """``gpu_stack --device cpu`` with the archive unpacked first on ``PYTHONPATH``, as
    ``gpu_check.sh`` does on the device: every step succeeds, the server is the unpacked
    one, the answers are the reference's (not empty), and the shared prefix is reused."""
    site = tmp_path / "site"
    site.mkdir()
    with tarfile.open(server_archive(tmp_path, PYTHON, preset=0)) as tar:
        tar.extractall(site, filter="tar")
    out = tmp_path / "out"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")])}
    cmd = [sys.executable, "-m", "preble_backend.benchmarks.gpu_stack", "--device", "cpu", "--out", str(out)]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    results = json.loads((out / "stack.json").read_text())
    assert done.returncode == 0, done.stdout[-3000:]
    assert results["tritonserver"] == str(site / "pytriton" / "tritonserver")
    steps = results["steps"]
    for front in ("grpc", "openai"):
        assert steps[front]["identical"] and steps[front]["of"] == 8 and min(steps[front]["answer_chars"]) > 0
    assert steps["ttft"]["router_ms"] > 0 and steps["ttft"]["engine_ms"] > 0
    assert steps["load"]["requests"] == 32 and steps["load"]["hit_ratio"] > 0.5
    assert steps["nvml"]["gauges"] == {}  # a CPU engine has no GPU to sample
    assert (out / "tritonserver.preble_engine_0.log").is_file()
    assert results["decode_graphs"] == "no capture failure logged"  # a CPU engine captures nothing


PROBE_MODEL = """
import only_on_pythonpath  # the load fails here unless the stub sees the launcher's import path


class TritonPythonModel:
    def execute(self, requests):
        return []
"""
PROBE_CONFIG = """
backend: "python"
input [ { name: "X", data_type: TYPE_FP32, dims: [ 1 ] } ]
output [ { name: "Y", data_type: TYPE_FP32, dims: [ 1 ] } ]
instance_group [ { kind: KIND_CPU, count: 1 } ]
"""


@pytest.mark.server
def test_a_model_imports_what_only_the_import_path_of_its_launcher_holds(tmp_path, monkeypatch):
    """The wheel's stub ignores ``PYTHONPATH``: on the first lent GPU the router failed to
    load (no ``tritonclient``, unpacked onto ``PYTHONPATH`` there). The server's models now
    import what the process that started the server can."""
    from server_utils import fresh_ports

    from preble_backend.runtime.launcher import start_server

    package = tmp_path / "extra" / "only_on_pythonpath"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("")
    model = tmp_path / "repo" / "probe"
    (model / "1").mkdir(parents=True)
    (model / "1" / "model.py").write_text(PROBE_MODEL)
    (model / "config.pbtxt").write_text(PROBE_CONFIG)
    monkeypatch.syspath_prepend(str(package.parent))
    server = start_server(tmp_path / "repo", fresh_ports(), log_path=tmp_path / "server.log")
    try:
        server.wait_ready(120)
    finally:
        server.stop()


def test_the_stack_step_reports_a_failed_graph_capture_from_the_engines_log(tmp_path):
    from preble_backend.benchmarks.gpu_stack import graph_capture

    (tmp_path / "tritonserver.preble_engine_0.log").write_text("I1127 loading\nI1127 ready\n")
    assert graph_capture(tmp_path) == "no capture failure logged"
    line = "E1127 decode runs eagerly: capturing its CUDA graphs failed (RuntimeError: boom); ..."
    (tmp_path / "tritonserver.preble_engine_1.log").write_text(f"I1127 loading\n{line}\n")
    assert graph_capture(tmp_path) == f"capture failed (tritonserver.preble_engine_1.log): {line}"
