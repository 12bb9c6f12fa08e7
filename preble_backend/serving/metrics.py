"""Custom metrics on Triton's metrics port, every ``pb_utils`` metric call made by one thread.

Why one thread: in the Python backend (24.10, and unchanged since), ``Metric.increment``
and ``Metric.observe`` release the GIL and then rewrite the metric object's
shared-memory record (``SaveToSharedMemory`` replaces the record it sent last time)
without a lock. Two threads updating one metric at once free each other's records in the
stub's shared-memory pool; the pool's allocator is corrupted and tritonserver dies with
SIGSEGV or ``boost::interprocess::lock_exception``. The router updates metrics from a
thread per request, so callers here only enqueue; the publisher thread owns every
``MetricFamily`` and ``Metric`` object, creates them, updates them and deletes them
(metrics before their family, as ``pb_utils`` requires).

Every series carries the stub process's ``pid`` as a label. Triton shares one Prometheus
series among all the ``Metric`` objects made with the same family name and labels, in
whatever process, and frees it when the first of them is deleted (upstream
triton-inference-server/server#8663, open): when a model is reloaded, the new version
loads before the old one unloads, the old one's deletions free the series the new one
goes on updating, and tritonserver dies with SIGSEGV (seen here: ``preble bench``
switching the router's policy under traffic). With the pid in the labels, the two
versions never share a series.

Gauges are moved with ``increment(delta)``, never ``set``: ``set`` waits for the server
while holding the GIL, which stalls every Python thread of the stub for the round trip,
and if the server dies meanwhile the GIL is never released and the stub cannot exit.
"""

from __future__ import annotations

import json
import os
import queue
import threading
from dataclasses import dataclass

import triton_python_backend_utils as pb_utils

KINDS = ("counter", "gauge", "histogram")


@dataclass(frozen=True)
class MetricSpec:
    name: str
    kind: str  # counter | gauge | histogram
    description: str
    buckets: tuple[float, ...] | None = None  # histograms only


class Metrics:
    """Declared families, label sets made on first use. A disabled metrics service
    (``--allow-metrics=false``) makes every call a no-op."""

    def __init__(self, base_labels: dict[str, str], specs: list[MetricSpec]) -> None:
        for spec in specs:
            if spec.kind not in KINDS or (spec.kind == "histogram") != (spec.buckets is not None):
                raise ValueError(f"metric {spec.name}: kind {spec.kind!r} with buckets {spec.buckets}")
        self.base_labels = {**base_labels, "pid": str(os.getpid())}  # see the module docstring
        self.specs = {spec.name: spec for spec in specs}
        self._updates: queue.SimpleQueue = queue.SimpleQueue()
        self._gauges: dict[tuple[str, str], float] = {}  # each gauge's value as published
        self._thread = threading.Thread(target=self._publish_loop, name="preble-metrics", daemon=True)
        self._thread.start()

    # ---- callers (any thread) -------------------------------------------------------------

    def count(self, name: str, delta: float, labels: dict[str, str] | None = None) -> None:
        """Add ``delta`` (a zero delta still makes the counter visible)."""
        self._put(name, "counter", max(delta, 0), labels)

    def gauge(self, name: str, value: float, labels: dict[str, str] | None = None) -> None:
        self._put(name, "gauge", value, labels)

    def observe(self, name: str, value: float, labels: dict[str, str] | None = None) -> None:
        self._put(name, "histogram", value, labels)

    def _put(self, name: str, kind: str, value: float, labels: dict[str, str] | None) -> None:
        spec = self.specs.get(name)
        if spec is None or spec.kind != kind:
            raise KeyError(f"metric {name} is not a declared {kind}")
        self._updates.put((name, json.dumps(labels or {}, sort_keys=True), value))

    def close(self) -> None:
        """Publish what is queued, then delete every metric and family (on the thread)."""
        self._updates.put(None)
        self._thread.join(timeout=10)

    # ---- the publisher thread -------------------------------------------------------------

    def _publish_loop(self) -> None:
        families: dict[str, object] = {}
        metrics: dict[tuple[str, str], object] = {}
        enabled = True
        try:
            for spec in self.specs.values():
                kind = getattr(pb_utils.MetricFamily, spec.kind.upper())
                families[spec.name] = pb_utils.MetricFamily(spec.name, spec.description, kind)
        except pb_utils.TritonModelException as exc:
            if "metrics not supported" not in str(exc):
                raise
            enabled = False
        stop = False
        while not stop:
            batch = [self._updates.get()]
            while True:  # coalesce what piled up: one update per metric for counters and gauges
                try:
                    batch.append(self._updates.get_nowait())
                except queue.Empty:
                    break
            if None in batch:
                stop = True
                batch = [u for u in batch if u is not None]
            if enabled:
                try:
                    self._apply(batch, families, metrics)
                except Exception as exc:  # a metric lost, never the thread (the queue would grow)
                    pb_utils.Logger.log_error(f"preble metrics: {type(exc).__name__}: {exc}")
        metrics.clear()  # Metric objects go before their MetricFamily
        families.clear()

    def _apply(self, batch, families: dict, metrics: dict) -> None:
        sums: dict[tuple[str, str], float] = {}  # counters: what to add
        last: dict[tuple[str, str], float] = {}  # gauges: the latest value
        observed: list[tuple[tuple[str, str], float]] = []
        for name, labels, value in batch:
            kind = self.specs[name].kind
            if kind == "counter":
                sums[(name, labels)] = sums.get((name, labels), 0.0) + value
            elif kind == "gauge":
                last[(name, labels)] = value
            else:
                observed.append(((name, labels), value))
        for key, value in sums.items():
            self._metric(key, families, metrics).increment(value)
        for key, value in last.items():
            delta = value - self._gauges.get(key, 0.0)
            if delta or key not in self._gauges:
                self._metric(key, families, metrics).increment(delta)
            self._gauges[key] = value
        for key, value in observed:
            self._metric(key, families, metrics).observe(value)

    def _metric(self, key: tuple[str, str], families: dict, metrics: dict):
        metric = metrics.get(key)
        if metric is None:
            name, labels = key
            spec = self.specs[name]
            extra = {"buckets": list(spec.buckets)} if spec.buckets else {}
            metric = families[name].Metric(labels={**self.base_labels, **json.loads(labels)}, **extra)
            metrics[key] = metric
        return metric
