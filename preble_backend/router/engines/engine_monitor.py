"""Liveness of the engines a router forwards to.

Two signals, checked every ``interval_s`` on the monitor's own thread:

- a local engine's stub process (its pid comes with every engine report): one killed
  with ``kill -9`` is seen within an interval. Triton 2.51 neither restarts a decoupled
  model's stub nor ends the requests it held, so without this they would hang forever.
- a ``health`` probe, answered with the state of the engine loop: a loop that died or
  has been inside one iteration for ``timeout_s`` fails it, and so does a remote server
  that went away. A probe left unanswered for ``timeout_s`` counts only while the
  engine's responses have stopped too: under a burst the probe's answer queues behind
  thousands of token responses, and tokens arriving are proof of life.

An engine is reported down once (``on_down(i, reason)``) and up once when a probe
succeeds again (``on_up(i)``): a restarted remote server rejoins by itself. Every
answered probe hands its load snapshot over first (``on_load(i, load)``: what the engine
is, for the policy). A request that finds an engine unreachable reports it through
``suspect`` without waiting for the next probe. Engines that discovery adds are watched
from a first successful probe on (``watch``; a first probe that fails is logged once,
since such an engine was never up to be reported down); one that left is no longer
watched, and nothing is reported of it.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from preble_backend.common.procfs import process_alive
from preble_backend.router.engines.engine_client import EngineClient, EngineError, LocalEngine


class EngineMonitor:
    def __init__(
        self,
        engines: list[EngineClient],
        on_down: Callable[[int, str], None],
        on_up: Callable[[int], None],
        interval_s: float = 1.0,
        timeout_s: float = 10.0,
        warn: Callable[[str], None] = print,
        on_load: Callable[[int, dict], None] = lambda instance, load: None,
        probe_fields: Callable[[], dict] = dict,
    ) -> None:
        self.engines, self.on_down, self.on_up, self._warn = list(engines), on_down, on_up, warn
        self.on_load = on_load  # each answered probe's load snapshot
        self.probe_fields = probe_fields  # what each probe carries (the router's copy of tenants' service)
        self.interval_s, self.timeout_s = interval_s, timeout_s
        self.up = [True] * len(engines)
        self.watched = set(range(len(engines)))
        self._unanswered: set[int] = set()  # watched since they joined, no probe answered yet
        self._pids: list[int | None] = [None] * len(engines)
        self._probing: dict[int, float] = {}  # engine -> when its outstanding probe started
        self._probes: dict[int, threading.Thread] = {}  # engine -> its latest probe's thread
        self._progress = [0.0] * len(engines)  # engine -> when a response of it last arrived
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="preble-engine-monitor", daemon=True)
        self._started = False

    def start(self) -> None:
        """Start watching (idempotent)."""
        with self._lock:
            if self._started or self._stop.is_set():
                return
            self._started = True
        self._thread.start()

    def stop(self, timeout_s: float = 5.0) -> None:
        """Stop probing: cancel every stream to the engines, its probes among them (one to
        a dead engine would never be answered), and wait for the probe threads, which must
        not be inside gRPC when the stub's interpreter shuts down. Engines failing from
        here on are not reported."""
        deadline = time.monotonic() + timeout_s
        with self._lock:
            self._stop.set()
            started = self._started
        if started:
            self._thread.join(timeout=timeout_s)
        with self._lock:
            engines = list(self.engines)
        for engine in engines:
            engine.cancel_all()
        with self._lock:
            probes = list(self._probes.values())
        for probe in probes:
            probe.join(timeout=max(0.0, deadline - time.monotonic()))

    def watch(self, instance: int, engine: EngineClient) -> None:
        """Watch ``engine`` in slot ``instance`` (a new slot, or one whose engine left):
        down until a probe answers, which reports it up."""
        with self._lock:
            if instance == len(self.engines):
                self.engines.append(engine)
                self.up.append(False)
                self._pids.append(None)
                self._progress.append(0.0)
            self.engines[instance], self.up[instance], self._pids[instance] = engine, False, None
            self.watched.add(instance)
            self._unanswered.add(instance)

    def unwatch(self, instance: int) -> None:
        """The engine left: probe it no more, report nothing of it."""
        with self._lock:
            self.watched.discard(instance)

    def learn_pid(self, instance: int, load: dict) -> None:
        """A local engine's report names its stub's pid."""
        pid = load.get("pid")
        if isinstance(self.engines[instance], LocalEngine) and isinstance(pid, int):
            self._pids[instance] = pid

    def progress(self, instance: int) -> None:
        """A response of the engine arrived (any thread; a plain store)."""
        self._progress[instance] = time.monotonic()

    def suspect(self, instance: int, reason: str) -> None:
        """A request found the engine unreachable: down now; the probes bring it back."""
        self._down(instance, reason)

    # ---- the monitor thread ---------------------------------------------------------------

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            now = time.monotonic()
            with self._lock:
                watched = sorted(self.watched)
            for i in watched:
                pid = self._pids[i]
                if pid is not None and self.up[i] and not process_alive(pid):
                    self._down(i, f"its stub process {pid} exited")
                with self._lock:
                    started = self._probing.get(i)
                    if started is None:
                        self._probing[i] = now
                        probe = threading.Thread(target=self._probe, args=(i,), daemon=True)
                        self._probes[i] = probe
                        probe.start()
                silent = now - max(started or now, self._progress[i])
                if silent > self.timeout_s:
                    self._down(i, f"it has answered nothing, not even a health probe, for {silent:.0f}s")

    def _probe(self, instance: int) -> None:
        try:
            load = self.engines[instance].health(**self.probe_fields())
        except EngineError as exc:
            with self._lock:
                first = instance in self._unanswered
                self._unanswered.discard(instance)
            if first:
                self._warn(f"engine {self.engines[instance].name} joined but fails its health probe "
                           f"({exc}); it takes requests once it answers")  # fmt: skip
            self._down(instance, str(exc))
        except Exception as exc:  # not proof of death: silence past the timeout is
            self._warn(
                f"health probe of engine {self.engines[instance].name} failed: {type(exc).__name__}: {exc}"
            )
        else:
            self.learn_pid(instance, load)
            pid = self._pids[instance]
            if pid is not None and not process_alive(pid):
                return  # an answer sent just before the process died
            if not load.get("loop_alive", True):
                self._down(instance, "its engine loop thread has died")
                return
            if load.get("step_age_s", 0.0) > self.timeout_s:
                self._down(
                    instance, f"its engine loop has been in one iteration for {load['step_age_s']:.0f}s"
                )
                return
            self.on_load(instance, load)  # before on_up: the router learns the engine, then routes to it
            with self._lock:
                back = not self.up[instance] and instance in self.watched
                self.up[instance] = True
                self._unanswered.discard(instance)
            if back:
                self.on_up(instance)
        finally:
            with self._lock:
                self._probing.pop(instance, None)

    def _down(self, instance: int, reason: str) -> None:
        with self._lock:
            if not self.up[instance] or self._stop.is_set() or instance not in self.watched:
                return
            self.up[instance] = False
        self.on_down(instance, reason)
