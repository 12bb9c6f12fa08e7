"""Engines in crash domains of their own: one tritonserver per engine, watched and
restarted by ``preble serve`` (and the router's server too).

Triton 2.51's Python backend can abort a whole tritonserver when a stub dies at the wrong
moment (``boost::interprocess::lock_exception`` while it handles the dead stub's last
response), so an engine that shares the router's server can take every client's stream
with it. Here each engine model runs in a server of its own, on loopback ports that
only the router uses, behind a key only the router holds;
the router reaches it as a remote engine (``grpc://127.0.0.1:port/model``), which it
already routes around while it is down and resyncs from its cache snapshot when it is
back. The supervisor restarts a server whose process exited, or whose engine stub died
(Triton keeps such a model "ready" and never unloads it): at once if it had served, else
after a backoff that doubles on each failed start; on the same ports, so the router's
configuration (and the clients' addresses, for the router's server) stay true.
"""

from __future__ import annotations

import re
import shutil
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

from preble_backend.common.procfs import children, command_name, process_tree
from preble_backend.runtime.access import LOOPBACK, Access
from preble_backend.runtime.launcher import (
    LaunchError,
    ServerPorts,
    TritonServer,
    free_ports,
    start_server,
)
from preble_backend.serving.pbtxt import config_parameter, set_config_parameter

STUB = "triton_python_"  # the stub's command name, as /proc truncates it
# A server that fails to start is started again after a backoff that doubles; one that
# had served is restarted at once, however soon it died: a kill is no crash loop, and a
# backoff there kept the fifth kill of one engine out for 36 s (benchmarks/engine_restart.py).
BACKOFF_S = (1.0, 2.0, 4.0, 8.0, 16.0, 30.0)


@dataclass
class Supervised:
    """One tritonserver (an engine model's, or the router's) and its restart state.
    ``access``/``env``: its own, else the supervisor's; ``watch_stub``: a dead stub fails
    it (an engine's; the router's stub is replaced while a policy switch reloads it)."""

    model: str
    repository: Path
    ports: ServerPorts
    log_path: Path
    access: Access | None = None
    env: dict[str, str] | None = None
    extra_args: tuple[str, ...] = ()
    watch_stub: bool = True
    role: str = "engine"  # how the console names it
    server: TritonServer | None = None
    ready_since: float | None = None  # when it was last seen ready (None: not since its start)
    failures: int = 0  # failed starts in a row: the backoff's index
    restart_at: float | None = None
    restarts: int = 0
    had_stub: bool = False

    @property
    def label(self) -> str:
        return f"{self.role} {self.model}"

    @property
    def url(self) -> str:
        """The router's ``engines`` entry: named as the model, so answers and metrics say
        ``preble_engine_0``, not a private port."""
        return f"{self.model}=grpc://{LOOPBACK}:{self.ports.grpc}/{self.model}"


@dataclass
class Supervisor:
    """Starts the engine servers, then keeps them up (``poll`` from the serving loop)."""

    units: list[Supervised]  # the engines' servers, then the router's
    access: Access
    env: dict[str, str]
    log: Callable[[str], None] = print
    clock: Callable[[], float] = time.monotonic
    backoff_s: tuple[float, ...] = BACKOFF_S

    def start(self, timeout_s: float = 300.0) -> None:
        """Start every engine server and wait until all are ready; one line on failure."""
        for engine in self.units:
            self._launch(engine)
        deadline = self.clock() + timeout_s
        for engine in self.units:
            try:
                engine.server.wait_ready(max(1.0, deadline - self.clock()))
            except LaunchError as exc:
                self.stop()
                raise LaunchError(f"{engine.label}: {exc}") from None
            engine.ready_since = self.clock()

    def add(self, unit: Supervised, cancelled: Callable[[], bool], timeout_s: float = 300.0) -> bool:
        """Start one more server (the router's), wait until it is ready, and keep it up from
        then on; False if ``cancelled()`` first. The others are kept up meanwhile."""
        self._launch(unit)
        deadline = self.clock() + timeout_s
        while not unit.server.is_ready():
            if cancelled():
                unit.server.stop()
                return False
            if unit.server.process.poll() is not None:
                raise LaunchError(f"tritonserver exited: {unit.server.failure()}")
            if self.clock() > deadline:
                unit.server.stop()
                raise LaunchError(f"tritonserver not ready after {timeout_s:.0f}s: {unit.server.failure()}")
            self.poll()
            time.sleep(0.25)
        unit.ready_since = self.clock()
        self.units.append(unit)
        return True

    def _launch(self, unit: Supervised) -> None:
        unit.server = start_server(
            unit.repository, unit.ports, log_path=unit.log_path, extra_args=list(unit.extra_args),
            access=unit.access or self.access, env=unit.env or self.env,
        )  # fmt: skip
        unit.had_stub, unit.ready_since = False, None

    def poll(self) -> None:
        """One look at every engine server: restart what died, once its backoff is over."""
        now = self.clock()
        for engine in self.units:
            if engine.server is None:
                continue
            if engine.restart_at is not None:
                if now >= engine.restart_at:
                    self._restart(engine)
                continue
            reason = self._failure(engine)
            if reason is None:
                if engine.ready_since is None and engine.server.is_ready():
                    engine.ready_since = now
                    if engine.restarts:
                        self._say(f"{engine.label} is back (restart {engine.restarts})")
                continue
            served = engine.ready_since is not None  # it started fine: a death, not a failing start
            engine.failures = 0 if served else engine.failures + 1
            delay = 0.0 if served else self._delay(engine.failures)
            self._say(f"{engine.label} failed ({reason}); restarting it in {delay:g}s")
            engine.server.stop(timeout=0.5)  # nothing to save: its streams fail over at once
            engine.restart_at = now + delay

    def _failure(self, engine: Supervised) -> str | None:
        """Why the engine's server cannot serve, or None. Stubs count once the server is
        ready: while a model loads, Triton runs a short-lived stub to complete its config."""
        process = engine.server.process
        if process.poll() is not None:
            return f"its tritonserver exited with code {process.returncode}: {engine.server.failure()}"
        if engine.ready_since is None or not engine.watch_stub:
            return None
        if children(process.pid, STUB):
            engine.had_stub = True
        elif engine.had_stub:
            return "its engine's stub process exited"
        return None

    def _restart(self, engine: Supervised) -> None:
        engine.restart_at = None
        engine.restarts += 1
        try:
            self._launch(engine)
        except LaunchError as exc:  # its port is still held, say: try again after the next backoff
            engine.failures += 1
            delay = self._delay(engine.failures)
            self._say(f"{engine.label} could not restart ({exc}); next try in {delay:g}s")
            engine.restart_at = self.clock() + delay

    def _say(self, line: str) -> None:
        self.log(f"preble serve: {line}")

    def _delay(self, failures: int) -> float:
        """The backoff after ``failures`` failed starts in a row."""
        return self.backoff_s[min(max(failures - 1, 0), len(self.backoff_s) - 1)]

    def stop(self) -> None:
        """Stop every server, all at once (each takes seconds to unload its model)."""
        running = [e.server for e in self.units if e.server is not None and e.server.process.poll() is None]
        for server in running:
            server.process.terminate()
        for engine in self.units:
            if engine.server is not None:
                engine.server.stop(timeout=30)


# ---- the layout: the repository split into one per engine and the router's ----------------


def split_repository(
    repository: Path, run_dir: Path, avoid: Iterable[int] = ()
) -> tuple[Path, list[Supervised]]:
    """The router's repository and one per local engine under ``run_dir``, from a
    repository that holds them together: each engine model alone in its own, the router
    forwarding to it at ``grpc://127.0.0.1:port`` (no port in ``avoid``). Version
    directories are links to the originals; each ``config.pbtxt`` is copied with relative
    ``model_path`` values made absolute (the originals are relative to ``repository``)."""
    router_config = (repository / "preble" / "config.pbtxt").read_text()
    entries = [e.strip() for e in (config_parameter(router_config, "engines") or "").split(",") if e.strip()]
    servers: list[Supervised] = []
    urls = []
    for entry in entries:
        if "://" in entry:
            urls.append(entry)
            continue
        if not (repository / entry / "config.pbtxt").is_file():
            raise LaunchError(f"engines: model {entry!r} is not in the model repository {repository}")
        ports = ServerPorts(*free_ports(3, avoid))
        engine = Supervised(entry, run_dir / "engines" / entry, ports, run_dir / f"{entry}.log")
        _link_model(repository, entry, engine.repository)
        servers.append(engine)
        urls.append(engine.url)
    router_repo = run_dir / "router"
    _link_model(repository, "preble", router_repo, engines=",".join(urls))
    return router_repo, servers


def _link_model(repository: Path, model: str, into: Path, **parameters: str) -> None:
    source = repository / model
    target = into / model
    if target.exists():
        shutil.rmtree(target)
    target.mkdir(parents=True)
    text = (source / "config.pbtxt").read_text()
    path = config_parameter(text, "model_path")
    if path and not Path(path).is_absolute() and (repository / path).is_dir():
        text = set_config_parameter(text, "model_path", str((repository / path).resolve()))
    for key, value in parameters.items():
        text = set_config_parameter(text, key, value)
    (target / "config.pbtxt").write_text(text)
    for version in source.iterdir():
        if version.is_dir() and re.fullmatch(r"\d+", version.name):
            (target / version.name).symlink_to(version.resolve(), target_is_directory=True)


def engine_stub(serve_pid: int, engine: str) -> int:
    """The pid of ``engine``'s stub under the ``preble serve`` process ``serve_pid`` (its
    server's repository is ``.../engines/<engine>``, as ``split_repository`` lays it out)."""
    for pid in process_tree(serve_pid):
        if command_name(pid).startswith(STUB):
            server = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1]
            if f"/engines/{engine}".encode() in Path(f"/proc/{server}/cmdline").read_bytes():
                return pid
    raise LookupError(f"no stub of {engine} under preble serve {serve_pid}")
