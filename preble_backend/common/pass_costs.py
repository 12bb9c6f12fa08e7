"""What an engine's forward passes cost, kept as running sufficient statistics (the
engine's side of E2's online cost model, ``scheduler/calibration.py``).

Each pass is a row ``x`` of the cost model's terms (``TERMS``: one, prefill tokens,
decoding requests, context tokens attended, tokens copied between tiers, and for a
mixture the expected share of its experts the batch's tokens read) and its wall time
``y`` in milliseconds, both divided by the pass's scale ``s`` (below). The engine keeps
``Σ w·x·xᵀ/s²``, ``Σ w·x·y/s²``, ``Σ w·y²/s²`` and ``Σ w`` since it started, per kind
of pass (``eager``, or a decode that replayed a CUDA graph: a replay skips the
launches, so its base differs); a least-squares fit needs
nothing else, and a report is ~35 numbers per kind whatever the traffic. Cumulative
sums let a router that missed reports, or several routers, read the same numbers; each
takes differences between its reports.

Relative: each pass enters divided by its time as predicted by the engine's running fit
(its measured time before there is one, and never below half or above twice it), so the
fit minimizes relative errors. In milliseconds an 8 s prefill outweighs every 100 ms
decode: the absolute fit of SmolLM2's served passes on one core came out with base 0 and
priced one-request decodes 26–79% low (``benchmarks/calibration.md``).

Robust: after a burn-in, each pass is weighed against the engine's own running fit: a
pass whose relative residual is beyond ``HUBER`` × the fit's RMS one (and beyond
``RELATIVE``) counts with weight ``(bound / |residual|)²``, which fades faster than
Huber's ``bound / |residual|`` (2% of passes at 10x moved the fitted base 10% under Huber's,
0.5% under this: test_calibration), so a pause of the host (a collection, a page-fault storm) moves no
coefficient far. Those passes are counted (``outliers``).
"""

from __future__ import annotations

import math
import threading

import numpy as np

from preble_backend.common.cost_model import expert_share

TERMS = ("base_ms", "prefill_ms_per_token", "decode_ms_per_request", "attention_ms_per_context_token",
         "load_ms_per_token", "experts_ms")  # fmt: skip
N = len(TERMS)
UPPER = [(i, j) for i in range(N) for j in range(i, N)]  # xᵀx is symmetric: its upper triangle
REFIT = 32  # passes before any is down-weighted, and between the engine's own refits
HUBER = 3.0
RELATIVE = 0.25


def row(prefill: int, decodes: int, context: int, moved: int = 0, num_experts: int = 0, top_k: int = 0):
    return (1.0, float(prefill), float(decodes), float(context), float(moved),
            expert_share(prefill + decodes, num_experts, top_k))  # fmt: skip


class PassSums:
    """One kind of pass: the weighted sums, and the running fit that weighs new passes."""

    __slots__ = ("passes", "weight", "xtx", "xty", "yty", "outliers", "_beta", "_bound")

    def __init__(self) -> None:
        self.passes, self.weight, self.yty, self.outliers = 0, 0.0, 0.0, 0
        self.xtx, self.xty = [0.0] * len(UPPER), [0.0] * N
        self._beta: list[float] | None = None
        self._bound = math.inf

    def add(self, x: tuple, ms: float) -> None:
        weight, scale = 1.0, ms
        predicted = sum(b * v for b, v in zip(self._beta, x)) if self._beta is not None else 0.0
        if predicted > 0:
            scale = min(2 * ms, max(ms / 2, predicted))
            residual = abs(ms - predicted) / predicted
            bound = max(self._bound, RELATIVE)
            if residual > bound:
                weight, self.outliers = (bound / residual) ** 2, self.outliers + 1
        self.passes += 1
        self.weight += weight
        w = weight / max(scale, 1e-9) ** 2
        self.yty += w * ms * ms
        for k, (i, j) in enumerate(UPPER):
            self.xtx[k] += w * x[i] * x[j]
        for i in range(N):
            self.xty[i] += w * x[i] * ms
        if self.passes % REFIT == 0:
            self._refit()

    def _refit(self) -> None:
        """Only once the passes tell the base from the per-token costs: before, a pass of
        a kind not seen yet (the first decodes) would be judged by a fit that cannot
        predict it."""
        a, b, yty = normal_equations(self.report())
        if not separable(a):
            return
        beta = np.linalg.lstsq(a, b, rcond=None)[0]
        sse = yty - 2 * beta @ b + beta @ a @ beta
        self._beta = [float(v) for v in beta]
        self._bound = HUBER * math.sqrt(max(float(sse), 0.0) / max(self.weight, 1e-9))  # relative

    def report(self) -> dict:
        return {"n": self.passes, "w": self.weight, "xtx": list(self.xtx), "xty": list(self.xty),
                "yty": self.yty, "outliers": self.outliers}  # fmt: skip


def separable(a: np.ndarray) -> bool:
    """The passes behind ``a = XᵀWX`` tell the base, per-token and per-request costs apart
    (those they have: decodes that replay a graph have no prefill): that block, as
    correlations (so scale does not matter), is not near-singular."""
    live = [i for i in range(3) if a[i, i] > 0]
    if len(live) < 2:
        return False
    block = a[np.ix_(live, live)]
    d = np.sqrt(np.diag(block))
    eig = np.linalg.eigvalsh(block / np.outer(d, d))
    return bool(eig[0] > 1e-6 * eig[-1])


def normal_equations(report: dict) -> tuple[np.ndarray, np.ndarray, float]:
    """(``Σ w·x·xᵀ``, ``Σ w·x·y``, ``Σ w·y²``) of a kind's report."""
    a = np.zeros((N, N))
    for k, (i, j) in enumerate(UPPER):
        a[i, j] = a[j, i] = report["xtx"][k]
    return a, np.array(report["xty"], dtype=float), float(report["yty"])


class PassCosts:
    """The engine's passes, per kind; ``report()`` goes out with each health answer."""

    def __init__(self, num_experts: int = 0, top_k: int = 0) -> None:
        self.num_experts, self.top_k = num_experts, top_k
        self.kinds: dict[str, PassSums] = {}
        self._lock = threading.Lock()  # the engine's thread adds, a health probe's reads

    def add(self, work: tuple, ms: float, graph: bool = False) -> None:
        """``work``: ``ScheduledBatch.work()``'s (prefill, decodes, context, moved, ...);
        ``graph``: a decode that replayed a CUDA graph."""
        prefill, decodes, context, moved = work[:4]
        x = row(prefill, decodes, context, moved, self.num_experts, self.top_k)
        kind = "graph" if graph else "eager"
        with self._lock:
            sums = self.kinds.get(kind) or self.kinds.setdefault(kind, PassSums())
            sums.add(x, ms)

    def report(self) -> dict:
        with self._lock:
            return {kind: sums.report() for kind, sums in self.kinds.items()}
