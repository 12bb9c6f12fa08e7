"""Starting real tritonservers for the server tests: free ports, a repository per test
module, and the check that every engine got every KV page back."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from client.triton_client import PrebleClient
from preble_backend.common.keys import ADMIN_KEY_ENV, bearer
from preble_backend.common.procfs import command_line, command_name, process_tree
from preble_backend.runtime.access import Access
from preble_backend.runtime.launcher import ServerPorts, free_port, free_ports, start_server
from preble_backend.runtime.repository import write_repository
from preble_backend.runtime.supervisor import engine_stub

# x86-64 system calls a thread may sleep in while it holds no lock: a futex wait
# (FUTEX_WAIT, FUTEX_WAIT_BITSET once the flags are masked off), poll, select, sleeps, and
# restart_syscall (219), which a timed wait or sleep that the stop interrupted shows.
_FUTEX, _FUTEX_WAITS = 202, (0, 9)
_SLEEPS = {7, 23, 35, 219, 230, 232, 270, 271, 281}


def _code_ranges(pid: int, names: tuple[str, ...]) -> list[tuple[int, int]]:
    """Address ranges of the executable mappings whose file name contains one of ``names``."""
    ranges = []
    for line in Path(f"/proc/{pid}/maps").read_text().splitlines():
        fields = line.split()
        if len(fields) >= 6 and "x" in fields[1] and any(n in fields[5] for n in names):
            lo, hi = (int(a, 16) for a in fields[0].split("-"))
            ranges.append((lo, hi))
    return ranges


def _holds_no_shared_lock(pid: int, unsafe: list[tuple[int, int]]) -> bool:
    """Whether no thread of a stopped stub can be inside the code that holds a mutex it
    shares with tritonserver (``unsafe``: the stub's own IPC code and the libc/pthread
    lock calls). A thread computing in torch or Python, or asleep in a futex wait, holds
    none."""
    for task in Path(f"/proc/{pid}/task").iterdir():
        fields = (task / "syscall").read_text().split()
        number = int(fields[0])
        if number == -1:  # stopped in user space: where?
            pc = int(fields[2], 16)
            if any(lo <= pc < hi for lo, hi in unsafe):
                return False
        elif number == _FUTEX:
            if int(fields[2], 16) & 0x7F not in _FUTEX_WAITS:
                return False  # a wake: sem_post or a notify, possibly under the mutex
        elif number not in _SLEEPS:
            return False
    return True


def kill_stub_between_sends(pid: int, timeout: float = 10.0) -> None:
    """SIGKILL a Python-backend stub at a moment it holds no mutex it shares with
    tritonserver. Triton 2.51's Python backend aborts the whole server when it locks a
    response mutex whose owner died (``ResponseSendDecoupled``: boost ``lock_exception``),
    and a stub streaming tokens holds one often enough that a blind ``kill -9`` took the
    server down in 2 of 10 runs. That is Triton's failure, not the router's: a test of the
    router stops the stub, kills it if it is in between, and lets it run on otherwise."""
    unsafe = _code_ranges(pid, ("triton_python_backend_stub", "libc.so", "libpthread"))
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        os.kill(pid, signal.SIGSTOP)
        tasks = list(Path(f"/proc/{pid}/task").iterdir())
        while any((t / "stat").read_text().rsplit(")", 1)[1].split()[0] != "T" for t in tasks):
            time.sleep(0.001)
        if _holds_no_shared_lock(pid, unsafe):
            os.kill(pid, signal.SIGKILL)
            return
        os.kill(pid, signal.SIGCONT)
        time.sleep(0.002)
    raise AssertionError(f"stub {pid} was never found between two sends")


def wait_for(condition, timeout: float, what: str) -> float:
    """Poll ``condition`` until it holds; fail naming ``what`` after ``timeout`` seconds.
    Returns how long it took."""
    start = time.monotonic()
    while not condition():
        assert time.monotonic() - start < timeout, f"{what} did not happen within {timeout}s"
        time.sleep(0.2)
    return time.monotonic() - start


def metric_value(url: str, name: str, label: str = "") -> float | None:
    """The value of metric ``name`` on the first line carrying ``label`` (``key="value"``)
    at ``url``'s ``/metrics``; None where there is none."""
    with urllib.request.urlopen(f"{url}/metrics", timeout=10) as r:
        for line in r.read().decode().splitlines():
            if line.startswith(name + "{") and label in line:
                return float(line.rsplit(" ", 1)[1])
    return None


def fresh_ports() -> ServerPorts:
    return ServerPorts(*free_ports(3))


def launch(repo: Path, log: Path, ready: bool = True, extra_args=None):
    """The repository in one tritonserver; its router takes admin control requests with the
    server's admin key."""
    access = Access()
    server = start_server(repo, fresh_ports(), log_path=log, extra_args=extra_args, access=access,
                          env={ADMIN_KEY_ENV: access.admin_key})  # fmt: skip
    if ready:
        server.wait_ready(300)
    return server


def client_for(server) -> PrebleClient:
    return PrebleClient(f"127.0.0.1:{server.ports.http}", f"127.0.0.1:{server.ports.grpc}")


def repository_index(server) -> list[dict]:
    req = urllib.request.Request(
        f"http://127.0.0.1:{server.ports.http}/v2/repository/index",
        data=b"{}",
        headers=bearer(server.access.admin_key),
    )  # the API is restricted
    with urllib.request.urlopen(req, timeout=10) as r:
        return json.loads(r.read())


def wait_idle(client: PrebleClient, engine: str, timeout: float = 30) -> dict:
    """Poll an engine until nothing waits or runs; return its load snapshot."""
    deadline = time.monotonic() + timeout
    while True:
        load = client.engine_control(engine, "stats")["load"]
        if load["running"] == 0 and load["waiting"] == 0 or time.monotonic() > deadline:
            return load
        time.sleep(0.1)


def assert_engine_pages_free(client: PrebleClient, engine: str) -> None:
    load = wait_idle(client, engine)
    assert load["running"] == 0 and load["waiting"] == 0, load
    assert load["kv_pages_used"] == load["kv_pages_cached"], load  # nothing private is left
    load = client.engine_control(engine, "flush_cache")["load"]
    assert load["kv_pages_free"] == load["kv_pages_total"], load


def write_test_repository(path: Path, **kw) -> Path:
    kw.setdefault("max_num_tokens", 8192)
    return write_repository(path, **kw)


GENERATE = "/v2/models/preble/generate"


def generate_body(prompt: str = "Hello", **params) -> bytes:
    """A generate request's JSON body (``max_tokens`` 4 unless given)."""
    params.setdefault("max_tokens", 4)
    return json.dumps({"text_input": prompt, "sampling_parameters": json.dumps(params)}).encode()


@dataclass
class Stack:
    """A ``preble serve`` child process and its public ports."""

    process: subprocess.Popen
    ports: ServerPorts
    openai_port: int
    lines: list[str]

    def engine_stub(self, model: str) -> int:
        """The pid of the stub of ``model``'s engine server (split layout)."""
        return engine_stub(self.process.pid, model)

    def pids(self) -> set[int]:
        """The stack's processes: ``preble serve``, the front, the servers and their stubs
        (not the stub watchers' passing ``sleep``s, nor a process already gone when its name
        is read: one such ``sh`` counted once failed a full run); a crash anywhere changes
        the set."""
        passing = ("", "sh", "sleep", "cut")
        return {p for p in process_tree(self.process.pid) if command_name(p) not in passing}

    def router_server(self) -> int:
        """The router's tritonserver: the one serving the run directory's router repository."""

        def serves_router(pid: int) -> bool:
            args = command_line(pid)
            return any(a.startswith(b"--model-repository=") and a.endswith(b"/router") for a in args)

        return next(p for p in process_tree(self.process.pid) if serves_router(p))

    def url(self, path: str, port: int | None = None) -> str:
        return f"http://127.0.0.1:{port or self.ports.http}{path}"

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 120) -> tuple[str, str]:
        if self.process.poll() is None:
            self.process.send_signal(sig)
        out, err = self.process.communicate(timeout=timeout)
        return "".join(self.lines) + out, err


def serve_stack(repo: Path, *args: str, env: dict | None = None, timeout: float = 300,
                ports: ServerPorts | None = None, openai_port: int | None = None) -> Stack:  # fmt: skip
    """``preble serve`` on fresh ports (or these), read until it says ready."""
    if ports is None:
        http, grpc, metrics, fresh_openai = free_ports(4)  # four distinct ones
        ports, openai_port = ServerPorts(http, grpc, metrics), openai_port or fresh_openai
    openai_port = openai_port or free_port()
    cmd = [sys.executable, "-m", "preble_backend.cli", "serve", "--model-repository", str(repo),
           "--http-port", str(ports.http), "--grpc-port", str(ports.grpc), "--metrics-port",
           str(ports.metrics), "--openai-port", str(openai_port), *args]  # fmt: skip
    process = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               env={**os.environ, **(env or {})})  # fmt: skip
    stack = Stack(process, ports, openai_port, [])
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        line = process.stdout.readline()
        if not line:
            raise AssertionError(f"preble serve ended: {''.join(stack.lines)}{process.stderr.read()}")
        stack.lines.append(line)
        if line.startswith("ready"):
            return stack
    process.kill()
    raise AssertionError(f"preble serve was not ready after {timeout}s: {''.join(stack.lines)}")


def http(method: str, url: str, body: bytes | None = None, headers: dict | None = None, timeout=60):
    """(status, headers with lower-case names, body) of one HTTP request; errors are
    answers too."""
    req = urllib.request.Request(url, data=body, method=method, headers=headers or {})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, {k.lower(): v for k, v in r.headers.items()}, r.read()
    except urllib.error.HTTPError as exc:
        return exc.code, {k.lower(): v for k, v in exc.headers.items()}, exc.read()


def wait_http_ready(url: str, timeout: float, process: subprocess.Popen) -> None:
    """Poll ``url`` until it answers 200 while ``process`` runs (a pod's readiness probe)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert process.poll() is None, f"the pod's process exited with {process.returncode}"
        try:
            with urllib.request.urlopen(url, timeout=2) as resp:
                if resp.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.5)
    raise AssertionError(f"{url} not ready in {timeout} s")


class Pods:
    """Pods (``deploy/entrypoint.py ROLE``) a test starts on this host, each logging to a
    file; ``env`` is what they share (the ConfigMap's and the Secret's part)."""

    def __init__(self, tmp_path: Path, env: dict[str, str]) -> None:
        self.tmp_path, self.env = tmp_path, env
        self.started: list[tuple[subprocess.Popen, Path]] = []

    def start(
        self, role: str, name: str, ports: ServerPorts | None = None, prefix=(), **env
    ) -> subprocess.Popen:
        """``prefix``: what runs the entrypoint (``ip netns exec NS``); ``env``: PREBLE_ settings."""
        env = {**os.environ, **self.env, "PREBLE_REPOSITORY": str(self.tmp_path / name), **env}
        if ports is not None:
            env.update(PREBLE_HTTP_PORT=str(ports.http), PREBLE_GRPC_PORT=str(ports.grpc),
                       PREBLE_METRICS_PORT=str(ports.metrics))  # fmt: skip
        log = self.tmp_path / f"{name}.log"
        entry = [sys.executable, str(Path(__file__).resolve().parent.parent / "deploy" / "entrypoint.py")]
        with open(log, "wb") as out:
            process = subprocess.Popen([*prefix, *entry, role], env=env, stdout=out, stderr=subprocess.STDOUT)
        self.started.append((process, log))
        return process

    def stop(self) -> None:
        """End any pod still running (SIGTERM first, so its entrypoint stops the tritonserver
        it started in a session of its own, which a kill would orphan); show their logs."""
        for process, log in reversed(self.started):
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
                try:
                    process.wait(30)
                except subprocess.TimeoutExpired:
                    process.kill()
            print(f"--- {log.name}\n{log.read_text()[-2500:]}")
