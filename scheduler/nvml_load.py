"""Live GPU load from NVML, merged with the engines' own reports into one load view.

A background thread samples each instance GPU's utilization and memory every
``interval_s``. The source is injectable (tests drive it with a fake). Without NVML (CPU
machines, no driver) the sampler says so once in the log and the view carries engine
reports alone.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass

log = logging.getLogger("preble.nvml")


@dataclass(frozen=True)
class GpuSample:
    utilization: float  # 0..1, SM busy fraction over the driver's last sample period
    memory_used: int
    memory_total: int

    @property
    def memory_fraction(self) -> float:
        return self.memory_used / self.memory_total if self.memory_total else 0.0


def nvml_source() -> Callable[[int | str], GpuSample] | None:
    """A sampler reading a GPU through nvidia-ml-py, named by its UUID or its index, or
    None when NVML is unavailable."""
    try:
        import pynvml

        pynvml.nvmlInit()
    except Exception as exc:  # no library, no driver, no GPU
        log.info("NVML unavailable (%s): load view uses engine reports only", exc)
        return None

    def read(gpu: int | str) -> GpuSample:
        if isinstance(gpu, str):
            handle = pynvml.nvmlDeviceGetHandleByUUID(gpu)
        else:
            handle = pynvml.nvmlDeviceGetHandleByIndex(gpu)
        util = pynvml.nvmlDeviceGetUtilizationRates(handle)
        mem = pynvml.nvmlDeviceGetMemoryInfo(handle)
        return GpuSample(util.gpu / 100.0, int(mem.used), int(mem.total))

    return read


class LoadView:
    """Per instance: the latest GPU sample (if any) and the latest engine report."""

    def __init__(self, gpus: list[int | str | None], source: Callable[[int | str], GpuSample] | None = None,
                 interval_s: float = 0.5) -> None:  # fmt: skip
        self.gpus = gpus
        self.interval_s = interval_s
        self.gpu: list[GpuSample | None] = [None] * len(gpus)
        self.reports: list[dict] = [{} for _ in gpus]
        self._source = source
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._warned = False

    def start(self) -> None:
        """Start sampling (again a no-op while running, or while no instance has a GPU)."""
        if self._thread is not None or not any(g is not None for g in self.gpus):
            return
        if self._source is None:
            self._source = nvml_source()
        if self._source is None:
            return
        self._thread = threading.Thread(target=self._run, name="preble-nvml", daemon=True)
        self._thread.start()

    def sample_once(self) -> None:
        for i, gpu in enumerate(self.gpus):
            if gpu is None or self._source is None:
                continue
            try:
                self.gpu[i] = self._source(gpu)
            except Exception as exc:
                if not self._warned:
                    log.warning("NVML sample of GPU %s failed (%s); keeping the last one", gpu, exc)
                    self._warned = True

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.sample_once()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()

    def add(self, instance: int) -> None:
        """Slot ``instance`` is a new engine's (appended) or a departed one's (cleared)."""
        if instance == len(self.gpus):
            self.gpus.append(None)
            self.gpu.append(None)
            self.reports.append({})
        self.gpus[instance], self.gpu[instance], self.reports[instance] = None, None, {}

    def report(self, instance: int, load: dict) -> None:
        self.reports[instance] = load

    def learn_gpu(self, instance: int, load: dict, on_this_host: bool) -> None:
        """Sample the GPU an engine on this host reports (its ``gpu_uuid``, which names it
        whatever ``CUDA_VISIBLE_DEVICES`` renumbered; else the index of its ``cuda:N``)
        from now on. An engine elsewhere has no GPU here to sample."""
        device = str(load.get("device", ""))
        if not on_this_host or not device.startswith("cuda") or self.gpus[instance] is not None:
            return
        self.gpus[instance] = load.get("gpu_uuid") or int(device.partition(":")[2] or 0)
        self.start()

    def snapshot(self, instance: int) -> dict:
        """Engine report plus ``gpu_utilization`` and ``gpu_memory_fraction`` when sampled."""
        out = dict(self.reports[instance])
        sample = self.gpu[instance]
        if sample is not None:
            out["gpu_utilization"] = sample.utilization
            out["gpu_memory_fraction"] = sample.memory_fraction
        return out
