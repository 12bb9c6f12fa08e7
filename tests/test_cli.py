"""``preble serve``: ready, endpoints printed, clean stop on SIGTERM; one clear line when a
port is taken or the repository is missing."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from server_utils import fresh_ports, http, write_test_repository

from preble_backend.common.version import __version__

pytestmark = pytest.mark.server


def serve(repo, ports, *more: str) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "preble_backend.cli", "serve", "--model-repository", str(repo), *more]
    cmd += [
        "--http-port",
        str(ports.http),
        "--grpc-port",
        str(ports.grpc),
        "--metrics-port",
        str(ports.metrics),
    ]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


@pytest.mark.parametrize("stop", [signal.SIGTERM, signal.SIGINT])  # SIGINT: Ctrl-C
def test_serve_prints_endpoints_and_stops_cleanly_on_sigterm(tmp_path, tiny_model, stop):
    ports = fresh_ports()
    proc = serve(write_test_repository(tmp_path / "repo", cpu_engines=1), ports)
    lines = []
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        lines.append(line)
        if line.startswith("ready"):
            break
    assert any(f"http://127.0.0.1:{ports.http}" in ln for ln in lines), lines
    assert any(f"127.0.0.1:{ports.grpc}" in ln for ln in lines), lines
    [model] = [ln for ln in lines if ln.startswith("  model ")]  # which model, its size and dtype
    assert "tiny: 4.2M parameters, float32, context 4096 tokens" in model and "random weights" in model
    assert f"; preble {__version__}" in model and re.fullmatch(r"\d+\.\d+\.\d+", __version__)
    assert any(ln.startswith(f"preble serve {__version__}: starting tritonserver") for ln in lines), lines
    status, _, body = http("GET", f"http://127.0.0.1:{ports.http}/v2")  # Triton's metadata, and ours
    assert status == 200 and json.loads(body)["preble_version"] == __version__, body
    assert json.loads(body)["name"] == "triton" and "extensions" in json.loads(body)
    [targets] = [Path(ln.split(" in ")[-1].strip()) for ln in lines if "engine scrape targets" in ln]
    assert_scrape_config_finds(targets, ports.metrics)
    proc.send_signal(stop)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err
    assert "stopped" in out and not targets.exists() and "Exit timeout" not in err
    with socket.socket() as s:  # nothing listens on the port any more (TIME_WAIT may linger)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("0.0.0.0", ports.http))


def assert_scrape_config_finds(targets: Path, metrics_port: int) -> None:
    """docs/grafana/prometheus.yml's one job scrapes the default metrics port, which
    carries the engine's series too; the file ``preble serve`` wrote lists the engine's own
    endpoint, which serves them as well."""
    import json
    import urllib.request

    import yaml

    path = Path(__file__).parent.parent / "docs" / "grafana" / "prometheus.yml"
    config = yaml.safe_load(path.read_text())
    [job] = config["scrape_configs"]
    assert job["static_configs"][0]["targets"] == ["127.0.0.1:8002"]  # the default port
    with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10) as r:
        federated = r.read().decode()
    assert 'preble_engine_kv_pages_free{engine="preble_engine_0",model="preble_engine_0"' in federated
    [group] = json.loads(targets.read_text())
    assert group["labels"] == {"engine": "preble_engine_0"}
    with urllib.request.urlopen(f"http://{group['targets'][0]}/metrics", timeout=10) as r:
        assert 'preble_engine_kv_pages_free{model="preble_engine_0"' in r.read().decode()


def test_serve_fails_with_one_line_when_a_port_is_taken(tmp_path):
    ports = fresh_ports()
    with socket.socket() as busy:
        busy.bind(("0.0.0.0", ports.grpc))
        busy.listen()
        proc = serve(write_test_repository(tmp_path / "repo", cpu_engines=1), ports)
        out, err = proc.communicate(timeout=60)
    assert proc.returncode == 1
    line = err.strip()  # this test's own process holds the port
    assert line.startswith(f"preble serve: port {ports.grpc} is already in use by ") and "\n" not in line
    assert f"(pid {os.getpid()})" in line, line


def test_serve_fails_with_one_line_when_the_repository_is_missing(tmp_path):
    proc = serve(tmp_path / "nowhere", fresh_ports())
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 1
    assert err.strip() == f"preble serve: model repository {tmp_path / 'nowhere'} does not exist"
    (tmp_path / "empty").mkdir()  # there, but nothing to serve: one line too, not a wait
    proc = serve(tmp_path / "empty", fresh_ports())
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 1
    assert err.strip().splitlines() == [
        f"preble serve: {tmp_path / 'empty'} holds no router model (preble/config.pbtxt): see `preble repo`"
    ]


@pytest.mark.parametrize("layout", ["split", "single"])
def test_serve_names_the_model_that_failed_to_load_and_why(tmp_path, tiny_model, layout):
    repo = write_test_repository(tmp_path / "repo", cpu_engines=1)
    config = repo / "preble" / "config.pbtxt"
    config.write_text(config.read_text().replace('"preble_engine_0"', '"preble_engine_0,preble_engine_9"'))
    proc = serve(repo, fresh_ports(), "--layout", layout)
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 1
    if layout == "single":  # the router's own load fails, and the server's log says why
        assert "preble serve: tritonserver exited: model preble failed to load:" in err, err
    assert f"engines: model 'preble_engine_9' is not in the model repository {repo}" in err, err
    assert len(err.strip().splitlines()) == 1, err


@pytest.mark.parametrize(
    "args, message",
    [
        (["simulate", "--policies", "e2,bogus"],
         "preble simulate: error: argument --policies: 'bogus' is not one of e2, round_robin, least_load, "
         "prefix_hash, cache_aware, kv_cost"),
        (["bench", "--rates", "1,x"],
         "preble bench: error: argument --rates: '1,x' is not a comma-separated list of rates > 0"),
        (["bench", "--workload", "chess"],
         "preble bench: error: argument --workload: invalid choice: 'chess'"),
        (["repo", "OUT", "--cost-model", "nosuch"],
         "preble repo: error: argument --cost-model: cost_model='nosuch' is invalid: "
         "no such file or shipped fit"),
        (["serve", "--http-port", "70000"],
         "preble serve: error: argument --http-port: '70000' is not a port number (1-65535)"),
        (["repo", "OUT", "--attention-backend", "cuda"],
         "preble repo: error: argument --attention-backend: invalid choice: 'cuda'"),
        (["repo", "OUT", "--cpu-engines", "0"],
         "preble repo: error: argument --cpu-engines: '0' is not an integer > 0"),
        (["repo", "OUT", "--model-path", "/nonexistent"],
         "preble repo: error: model_path='/nonexistent' is invalid: /nonexistent holds no config.json"),
        (["repo", "OUT", "--model-path", "smollm3"], "preble repo: error: model_path='smollm3' is invalid: "),
    ],
)  # fmt: skip
def test_a_bad_value_is_one_line_naming_it_and_writes_nothing(tmp_path, args, message):
    args = [str(tmp_path / "out") if a == "OUT" else a for a in args]
    proc = subprocess.run([sys.executable, "-m", "preble_backend.cli", *args], capture_output=True, text=True)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines()[-1].startswith(message), proc.stderr
    if "smollm3" in args:  # a name that is not a directory: the known names
        assert proc.stderr.strip().endswith("(and it is not a model name: tiny, smollm2)")
    assert "Traceback" not in proc.stderr and not (tmp_path / "out").exists()


def test_every_option_is_explained_with_its_default():
    from preble_backend.cli import build_parser

    parser = build_parser()
    commands = next(a for a in parser._actions if a.dest == "command").choices
    for name, sub in commands.items():
        for action in sub._actions:
            if action.dest == "help":
                continue
            assert action.help, f"preble {name} {action.option_strings or action.dest} has no help"
        text = sub.format_help()
        assert "(default:" in text or name == "model", name
        assert "(default: None)" not in text, name  # an option without a default says what then
        for action in sub._actions:  # the formatter adds the default once: no help says it again
            assert "(default:" not in (action.help or ""), (name, action.help)


@pytest.mark.parametrize("command", ["", "serve", "repo", "profile", "workload", "simulate", "bench", "model",
                                     "demo"])  # fmt: skip
def test_help_answers_without_importing_heavy_modules(command):
    """``preble --help`` and each command's ``--help`` parse before they import a command's
    module (it took 4.4 s when torch and transformers came first, and numpy through the
    workloads' names 1.7 s more)."""
    heavy = ("torch", "transformers", "fastapi", "tritonclient", "numpy")
    argv = [command, "--help"] if command else ["--help"]
    code = "\n".join(["import sys", "from preble_backend.cli import main", "try:", f"    main({argv!r})",
                      "except SystemExit:", "    pass",
                      f"print(sorted(m for m in {heavy} if m in sys.modules))"])  # fmt: skip
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and done.stdout.strip().splitlines()[-1] == "[]", done.stdout + done.stderr
    assert "``" not in done.stdout and "(default: None)" not in done.stdout  # no markup, no empty defaults


def test_a_bad_config_value_is_one_line_naming_it(tmp_path):
    repo = write_test_repository(tmp_path / "repo", cpu_engines=1)
    config = repo / "preble_engine_0" / "config.pbtxt"
    text = config.read_text()
    good, bad = (f'"chunk_size" value: {{ string_value: "{v}" }}' for v in ("512", "0"))
    config.write_text(text.replace(good, bad))
    proc = serve(repo, fresh_ports(), "--openai-port", "0")
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 1
    line = (
        "preble serve: engine preble_engine_0: tritonserver exited with code 1: model preble_engine_0 "
        "failed to load: ValueError: chunk_size=0 is invalid: expected an integer >= 1"
    )
    assert err.strip().splitlines() == [line], err
