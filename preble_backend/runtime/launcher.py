"""Start tritonserver on a model repository, on a machine without an NGC container.

Outside an NGC container the server comes from the ``nvidia-pytriton`` wheel. Its Python
backend needs a backend directory holding ``libtriton_python.so``, the utils module and
the stub built for the running interpreter's version; the stub's embedded Python ignores
``PYTHONPATH`` and finds site-packages through the first ``python3`` on ``PATH``, so a
virtual environment of the server's own goes first, one whose ``.pth`` gives the stub this
interpreter's import path (``PYTHONPATH`` and every site directory); the bundled libraries
and libpython go on ``LD_LIBRARY_PATH``. Inside an NGC container the ``tritonserver`` on
``PATH`` is used.
"""

from __future__ import annotations

import contextlib
import http.client
import importlib.util
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import tempfile
import time
import urllib.request
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from preble_backend.common.procfs import die_with_parent, group_running, port_holder, terminate
from preble_backend.runtime.access import Access

LOAD_FAILURE = re.compile(r"failed to load '([^']+)' version \d+: (.*?)\"?$")
BENIGN = re.compile(r"CudaDriverHelper|NVML|DCGM|pinned memory|CUDA driver")
EXIT_TIMEOUT_S = 5  # Triton's default is 30: see start_server


class LaunchError(RuntimeError):
    """A one-line reason the server cannot start."""


@dataclass
class ServerPorts:
    http: int = 8000
    grpc: int = 8001
    metrics: int = 8002

    def endpoints(self, host: str = "127.0.0.1") -> dict[str, str]:
        return {
            "http": f"http://{host}:{self.http}",
            "grpc": f"{host}:{self.grpc}",
            "metrics": f"http://{host}:{self.metrics}/metrics",
        }


@dataclass
class TritonServer:
    """A running tritonserver child process."""

    process: subprocess.Popen
    ports: ServerPorts
    log_path: Path
    workdir: Path
    access: Access = field(default_factory=Access)

    def is_ready(self) -> bool:
        try:
            url = f"http://{self.access.client_host}:{self.ports.http}/v2/health/ready"
            with urllib.request.urlopen(url, timeout=1) as resp:
                return resp.status == 200
        except (OSError, http.client.HTTPException):  # not answering, or not as tritonserver
            return False

    def wait_ready(self, timeout: float = 300.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise LaunchError(
                    f"tritonserver exited with code {self.process.returncode}: {self.failure()}"
                )
            if self.is_ready():
                return
            time.sleep(0.25)
        self.stop()
        raise LaunchError(f"tritonserver was not ready after {timeout:.0f}s: {self.failure()}")

    def failure(self) -> str:
        """Why the server failed, from its log: each model that failed to load and the
        reason it gave; else the last error line that is not one of the warnings a CPU
        machine always logs (CUDA, NVML, DCGM)."""
        lines = self.log_path.read_text(errors="replace").splitlines() if self.log_path.exists() else []
        models: dict[str, str] = {}
        for line in lines:
            found = LOAD_FAILURE.search(line)
            if found:  # the stub's reason, without the Python stack it appends ("\n\nAt:\n  ...")
                reason = found.group(2).replace('\\"', '"').split("\\n")[0].strip()
                models[found.group(1)] = reason.removeprefix("Internal: ")
        if models:
            return "; ".join(
                f"model {name} failed to load: {reason[-400:]}" for name, reason in models.items()
            )
        errors = [ln for ln in lines if ln.startswith("E") and not BENIGN.search(ln)]
        errors += [ln for ln in lines if "Signal (" in ln or "terminate called" in ln]
        if errors:
            return errors[-1].strip()[-600:]
        return lines[-1].strip() if lines else "no log output"

    def stop(self, timeout: float = 60.0) -> int:
        terminate(self.process, timeout)
        # The server led its own process group: end what it left behind (Python backend
        # stubs outlive a server that crashed or was killed).
        try:
            os.killpg(self.process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        deadline = time.monotonic() + 10  # a killed process takes a moment to die
        while group_running(self.process.pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        shutil.rmtree(self.workdir, ignore_errors=True)
        return self.process.returncode


def wheel_root() -> Path | None:
    """The ``nvidia-pytriton`` wheel's server, found without importing the package (whose
    own imports need packages the server does not: a GPU host given only the server's
    files has none of them)."""
    spec = importlib.util.find_spec("pytriton")
    if spec is None or not spec.submodule_search_locations:
        return None
    root = Path(next(iter(spec.submodule_search_locations))) / "tritonserver"
    return root if (root / "bin" / "tritonserver").is_file() else None


def check_stub_numpy(version: str) -> None:
    """Refuse numpy 2 beside the wheel's stub: Triton 2.51's Python backend stub is built
    with a pybind11 older than 2.12, which reads numpy 2's dtype descriptor at numpy 1's
    offsets, so every tensor reaches a model as its first byte repeated (on a lent H200
    with numpy 2.5.2 both stubs crashed on their first request)."""
    if int(version.split(".")[0]) >= 2:
        raise LaunchError(
            f"numpy {version} is on the import path: the Python backend stub of nvidia-pytriton's "
            "Triton 2.51 misreads numpy 2 arrays (every tensor arrives as its first byte repeated); "
            "install numpy<2 (pip install 'numpy<2')"
        )


def _backend_dir(wheel: Path, workdir: Path) -> Path:
    """``backends/python`` with the stub of this interpreter's version."""
    import numpy

    check_stub_numpy(numpy.__version__)
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    stub = wheel / "python_backend_stubs" / version / "triton_python_backend_stub"
    if not stub.is_file():
        raise LaunchError(f"nvidia-pytriton ships no Python backend stub for Python {version}")
    python_dir = workdir / "backends" / "python"
    python_dir.mkdir(parents=True)
    for name in ("libtriton_python.so", "triton_python_backend_utils.py"):
        (python_dir / name).symlink_to(wheel / "backends" / "python" / name)
    shutil.copy2(stub, python_dir / "triton_python_backend_stub")
    return workdir / "backends"


def stub_python(workdir: Path) -> Path:
    """A virtual environment over this interpreter whose one ``.pth`` adds this process's
    import path: packages found only through ``PYTHONPATH`` (a source checkout, a lent GPU
    machine's unpacked wheels) import in the stub as here. Returns its ``bin/``."""
    env = workdir / "python"
    (env / "bin").mkdir(parents=True)
    (env / "bin" / "python3").symlink_to(sys.executable)
    home = Path(getattr(sys, "_base_executable", sys.executable)).parent
    (env / "pyvenv.cfg").write_text(f"home = {home}\ninclude-system-site-packages = false\n")
    site_packages = env / "lib" / f"python{sys.version_info.major}.{sys.version_info.minor}" / "site-packages"
    site_packages.mkdir(parents=True)
    paths = [str(Path(p).resolve()) for p in sys.path if p and Path(p).is_dir()]
    # addsitedir also runs each directory's own .pth files (editable installs' finders); map,
    # since site.py execs the line where a comprehension cannot see ``site``
    line = f"import site; list(map(site.addsitedir, {paths!r}))\n"
    (site_packages / "preble_import_path.pth").write_text(line)
    return env / "bin"


def server_environment(wheel: Path | None, workdir: Path) -> dict[str, str]:
    env = dict(os.environ)
    python = stub_python(workdir) if wheel is not None else Path(sys.executable).parent
    env["PATH"] = f"{python}{os.pathsep}{env.get('PATH', '')}"
    if wheel is not None:  # the wheel's bundled libraries sit beside its package
        libs = [str(wheel.parents[1] / "nvidia_pytriton.libs"), sysconfig.get_config_var("LIBDIR") or ""]
        env["LD_LIBRARY_PATH"] = os.pathsep.join([*libs, env.get("LD_LIBRARY_PATH", "")])
    return env


def check_port_free(port: int, host: str = "127.0.0.1") -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            holder = port_holder(port)
            by = f" by {holder}" if holder else ""
            raise LaunchError(f"port {port} is already in use{by}: stop it or pick another port") from None


def free_port() -> int:
    return free_ports(1)[0]


_HANDED_OUT: set[int] = set()  # every port free_ports gave this process
QUIET_PORTS_FROM = 10000  # below: the ports well-known and registered services usually take


def ephemeral_port_range() -> tuple[int, int]:
    """The ports the kernel numbers itself: an outgoing connection's local port, a bind to 0."""
    try:
        low, high = map(int, Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
    except (OSError, ValueError):
        return 32768, 60999  # Linux's default
    return low, high


def free_ports(n: int, avoid: Iterable[int] = ()) -> list[int]:
    """``n`` distinct free loopback ports, none in ``avoid`` and none this process has
    handed out before, from below the kernel's ephemeral range.

    Between this choice and the server's own bind, a port in the ephemeral range can be
    taken by any socket the kernel numbers itself (a TP engine's gloo pairs took a server's
    metrics port while its models loaded, and the server died). Every socket stays bound
    until all are chosen, and a port once handed out is never handed out again: the server
    it went to may not have bound it yet (two engines of one ``preble serve`` were once
    given one port, and one's readiness probe reached the other's gRPC)."""
    taken = _HANDED_OUT | set(avoid)
    candidates = _quiet_ports()
    ports: list[int] = []
    with contextlib.ExitStack() as stack:
        while len(ports) < n:
            s = stack.enter_context(socket.socket())
            port = next((p for p in candidates if p not in taken and _binds(s, p)), None)
            if port is None:  # no quiet port free here: the kernel's choice
                s.bind(("127.0.0.1", 0))
                port = s.getsockname()[1]
            if port not in taken:
                ports.append(port)
                taken.add(port)
    _HANDED_OUT.update(ports)
    return ports


def _quiet_ports(tries: int = 1000) -> Iterator[int]:
    """Random ports below the ephemeral range (none where it starts too low); a system
    random source, so processes that seed ``random`` alike do not pick alike."""
    low, _ = ephemeral_port_range()
    if low - QUIET_PORTS_FROM >= 1000:
        rng = random.SystemRandom()
        yield from (rng.randrange(QUIET_PORTS_FROM, low) for _ in range(tries))


def _binds(s: socket.socket, port: int) -> bool:
    try:
        s.bind(("127.0.0.1", port))
    except OSError:
        return False
    return True


# Every model loaded at start, and loadable again with a configuration override (how
# ``preble bench`` switches the router's policy).
EXPLICIT_MODEL_CONTROL = ["--model-control-mode=explicit", "--load-model=*"]


def start_server(
    model_repository: str | Path,
    ports: ServerPorts | None = None,
    log_path: str | Path | None = None,
    extra_args: list[str] | None = None,
    exit_timeout_s: int = EXIT_TIMEOUT_S,
    access: Access | None = None,
    env: dict[str, str] | None = None,
) -> TritonServer:
    """Launch tritonserver (not yet waiting for readiness), listening and restricted as
    ``access`` says (default: loopback, the admin APIs behind a key only this process
    knows); ``env``: more environment for the server and its models (their keys).

    ``exit_timeout_s`` bounds how long a stopping server waits for models to unload.
    Healthy engines unload in about a second; but an engine whose stub process died
    never unloads in Triton 2.51 (the requests it held are never released), and the
    server would wait out Triton's 30 s default before exiting."""
    repo = Path(model_repository)
    if not repo.is_dir():
        raise LaunchError(f"model repository {repo} does not exist")
    ports = ports or ServerPorts()
    access = access or Access()
    for port in (ports.http, ports.grpc, ports.metrics):
        check_port_free(port, access.host)
    workdir = Path(tempfile.mkdtemp(prefix="preble-triton-"))
    wheel = wheel_root()
    if wheel is not None:
        binary = str(wheel / "bin" / "tritonserver")
        backend_args = [f"--backend-directory={_backend_dir(wheel, workdir)}"]
    elif shutil.which("tritonserver"):
        binary, backend_args = shutil.which("tritonserver"), []
    else:
        raise LaunchError("no tritonserver: install nvidia-pytriton or run inside an NGC Triton container")
    log = Path(log_path) if log_path else workdir / "tritonserver.log"
    cmd = [
        binary,
        f"--model-repository={repo.resolve()}",
        f"--http-port={ports.http}",
        f"--grpc-port={ports.grpc}",
        f"--metrics-port={ports.metrics}",
        "--allow-metrics=true",
        "--log-verbose=0",
        f"--exit-timeout-secs={exit_timeout_s}",
        *access.server_args(),
        *backend_args,
        *(extra_args or []),
    ]
    environment = {**server_environment(wheel, workdir), **(env or {})}
    with open(log, "ab") as out:
        process = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=environment,
                                   start_new_session=True, preexec_fn=die_with_parent)  # fmt: skip
    return TritonServer(process, ports, log, workdir, access)
