"""The OpenAI front as a child process of ``preble serve`` (and of the tests): started
once tritonserver is ready, checked healthy, stopped with the server."""

from __future__ import annotations

import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from preble_backend.serving.launcher import LaunchError


@dataclass
class OpenAIFront:
    process: subprocess.Popen
    port: int
    log_path: Path

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def healthy(self) -> bool:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=2) as r:
                return r.status == 200
        except OSError:
            return False

    def wait_healthy(self, timeout: float = 120.0) -> None:
        deadline = time.monotonic() + timeout
        while not self.healthy():
            if self.process.poll() is not None:
                raise LaunchError(f"the OpenAI front exited: {self.failure()}")
            if time.monotonic() > deadline:
                self.stop()
                raise LaunchError(f"the OpenAI front was not healthy after {timeout:.0f}s: {self.failure()}")
            time.sleep(0.25)

    def failure(self) -> str:
        text = self.log_path.read_text(errors="replace").strip() if self.log_path.exists() else ""
        return text.splitlines()[-1] if text else "no log output"

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


def start_openai_front(
    router_grpc: str, port: int, model_path: str, log_path: Path, served_model_name: str = "preble"
) -> OpenAIFront:
    """Launch the front (not yet waiting for it) on ``port``, forwarding to the router."""
    cmd = [
        sys.executable, "-m", "preble_backend.frontend.openai_server", "--router", router_grpc,
        "--model-path", model_path, "--port", str(port), "--served-model-name", served_model_name,
    ]  # fmt: skip
    with open(log_path, "ab") as out:
        process = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
    return OpenAIFront(process, port, log_path)
