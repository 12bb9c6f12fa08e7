"""The front (the OpenAI API and Triton's HTTP API, ``openai_server.py``) as a child
process of ``preble serve`` (and of the tests): started once tritonserver is ready,
checked answering, stopped before the server."""

from __future__ import annotations

import os
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from preble_backend.common.keys import ADMIN_KEY_ENV, API_KEY_ENV
from preble_backend.common.procfs import die_with_parent, terminate
from preble_backend.common.settings import MAX_BODY_BYTES
from preble_backend.runtime.access import Access
from preble_backend.runtime.launcher import LaunchError, TritonServer


@dataclass
class OpenAIFront:
    process: subprocess.Popen
    port: int  # the OpenAI API's (0: none)
    http_port: int  # Triton's HTTP API's (0: none)
    log_path: Path
    host: str = "127.0.0.1"

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}/v1"

    def health(self) -> int | None:
        """The status ``/health`` answers (200: ready, 503: up but not ready), None if none."""
        port = self.port or self.http_port
        try:
            with urllib.request.urlopen(f"http://{self.host}:{port}/health", timeout=2) as r:
                return r.status
        except urllib.error.HTTPError as exc:
            return exc.code
        except OSError:
            return None

    def healthy(self) -> bool:
        return self.health() == 200

    def wait_answering(self, timeout: float = 120.0) -> None:
        """Wait until the front answers (ready or not: engines may come later)."""
        deadline = time.monotonic() + timeout
        while self.health() is None:
            if self.process.poll() is not None:
                raise LaunchError(f"the front exited: {self.failure()}")
            if time.monotonic() > deadline:
                self.stop()
                raise LaunchError(f"the front did not answer after {timeout:.0f}s: {self.failure()}")
            time.sleep(0.25)

    def wait_healthy(self, timeout: float = 120.0) -> None:
        deadline = time.monotonic() + timeout
        self.wait_answering(timeout)
        while not self.healthy():
            if time.monotonic() > deadline:
                self.stop()
                raise LaunchError(f"the front was not healthy after {timeout:.0f}s: {self.failure()}")
            time.sleep(0.25)

    def failure(self) -> str:
        text = self.log_path.read_text(errors="replace").strip() if self.log_path.exists() else ""
        return text.splitlines()[-1] if text else "no log output"

    def stop(self, timeout: float = 10.0) -> None:
        """SIGTERM (the front drains: ``drain.py``), then SIGKILL after ``timeout``."""
        terminate(self.process, timeout)


def start_openai_front(
    router_grpc: str, port: int, model_path: str, log_path: Path, served_model_name: str = "preble",
    server: TritonServer | None = None, http_port: int = 0, access: Access | None = None,
    max_body_bytes: int = MAX_BODY_BYTES, drain_s: float = 30.0, model_name: str = "", dtype: str = "auto",
    metrics_port: int = 0, engine_metrics: dict[str, str] | None = None, grpc_port: int = 0,
    keys_file: str | None = None,
) -> OpenAIFront:  # fmt: skip
    """Launch the front (not yet waiting for it): the OpenAI API on ``port``, and with a
    ``server`` Triton's HTTP API on ``http_port``, forwarded to that server's own HTTP
    endpoint, Triton's gRPC API on ``grpc_port``, relayed to ``router_grpc``, and its
    metrics with every engine's (``engine_metrics``: name -> host:port) federated on
    ``metrics_port``; listening and keyed as ``access`` says (the keys go in the
    environment)."""
    access = access or Access()
    cmd = [
        sys.executable, "-m", "preble_backend.frontend.openai_server", "--router", router_grpc,
        "--model-path", model_path, "--port", str(port), "--served-model-name", served_model_name,
        "--model-name", model_name, "--dtype", dtype,
        "--host", access.host, "--max-body-bytes", str(max_body_bytes), "--drain-timeout", str(drain_s),
    ]  # fmt: skip
    if server is not None and http_port:
        local = server.access.client_host
        cmd += ["--http-port", str(http_port), "--triton-http", f"{local}:{server.ports.http}",
                "--triton-metrics", f"{local}:{server.ports.metrics}"]  # fmt: skip
        if grpc_port:
            cmd += ["--grpc-port", str(grpc_port)]
        if metrics_port:  # the public metrics port: the router's server's series and every engine's
            engines = ",".join(f"{name}={where}" for name, where in (engine_metrics or {}).items())
            cmd += ["--metrics-port", str(metrics_port), "--engine-metrics", engines]
    if keys_file:  # client keys name tenants; the API key is then the front's own, for tritonserver
        cmd += ["--keys-file", str(Path(keys_file).resolve())]
    env = {k: v for k, v in os.environ.items() if k not in (API_KEY_ENV, ADMIN_KEY_ENV)}
    if access.api_key:
        env[API_KEY_ENV] = access.api_key
    if server is not None and grpc_port:  # the gRPC gate tells the admin key from the API key
        env[ADMIN_KEY_ENV] = access.admin_key
    with open(log_path, "ab") as out:
        process = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env,
                                   preexec_fn=die_with_parent)  # fmt: skip
    return OpenAIFront(process, port, http_port if server is not None else 0, log_path, access.client_host)
