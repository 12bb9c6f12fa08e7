"""E2's cost model learnt online, one per engine (issue 63), from the pass statistics each
engine reports (``preble_backend/common/pass_costs.py``).

Each engine's fit is a non-negative least-squares fit (``cost_model.nnls``) of its passes'
wall times on the cost model's terms, in relative errors (the engine sums each pass divided
by its time: a fit in milliseconds is set by the longest prefills), over

- a **window**: the router takes differences of the engine's cumulative sums between
  reports and forgets old passes exponentially, ``window_passes`` passes deep, so a host
  that slows down (a neighbour, thermal limits) is followed;
- a **prior** (``cost_priors.py``), as pseudo-passes timed by it (``OnlineCost._solve``):
  it holds the directions the window has not exercised yet (no long prefill, no copy
  between tiers) and fades from the rest as passes come;
- each pass already **weighed** by the engine against outliers (Huber).

What E2 prices with (``model``) is the fit once the window holds ``min_passes`` passes
that tell the base from the per-token costs, else the prior, with the reason
(``CostFit.reason``): too few passes, a singular design, a fit that is not finite or
is no better than the prior. Decodes that replayed a CUDA graph are fitted apart: their
per-request and attention terms and their step are what DECODETIME uses, once there are
enough of them. A fit runs when ``refit_passes`` new passes came, off the request path
(the router's probe thread): a request never waits for one.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import numpy as np

from preble_backend.common.cost_model import CostModel, nnls
from preble_backend.common.pass_costs import TERMS, normal_equations, row, separable
from scheduler.cost_priors import TYPICAL_DECODE, Prior, with_decode_step

PRIOR_PREFILLS = (32, 128, 512, 2048)
PRIOR_DECODES = ((1, 128), (4, 512), (16, 512), (32, 2048))  # batch, context per request
GRID_PASSES = 0.5  # the prior's weight where the window has no passes
COPY_TOKENS = 1024  # the prior's copy between tiers
ROUNDING = 1e-6  # relative errors this far apart are equal: a prior that is the truth ties its fit
FLOOR = 1e-6  # the least trust: the grid still defines what no pass exercises


@dataclass(frozen=True)
class CostFit:
    """What an engine is priced with, and why: exported as gauges and in the live bench."""

    model: CostModel
    status: str  # fixed | prior | learnt | peer (a peer's learnt fit: ``Calibrated._settle``)
    prior: str
    prior_kind: str  # matches | estimate | mismatch | unknown
    reason: str = ""
    passes: float = 0.0  # the window's passes (weighted, decayed)
    error: float | None = None  # relative RMS error of ``model`` over the window's passes
    prior_error: float | None = None  # the prior's, over the same passes
    outliers: int = 0  # passes the engine down-weighted

    @property
    def mismatch(self) -> bool:
        """Priced with another model's or device's timings, or with a fit not known to be
        this engine's (it has not said what it serves)."""
        return self.status in ("fixed", "prior") and self.prior_kind in ("mismatch", "unknown")

    def summary(self) -> dict:
        m = self.model
        return {"status": self.status, "prior": self.prior, "prior_kind": self.prior_kind,
                "reason": self.reason, "passes": round(self.passes, 1), "error": self.error,
                "prior_error": self.prior_error, "outliers": self.outliers, "base_ms": m.base_ms,
                "prefill_ms_per_token": m.prefill_ms_per_token,
                "decode_ms_per_request": m.decode_ms_per_request,
                "attention_ms_per_context_token": m.attention_ms_per_context_token,
                "decode_step_ms": m.decode_step_ms, "load_ms_per_token": m.load_ms_per_token,
                "experts_ms": m.experts_ms}  # fmt: skip


class _Window:
    """One kind of pass: the engine's sums, forgotten exponentially by pass."""

    def __init__(self) -> None:
        n = len(TERMS)
        self.a, self.b, self.yty, self.w = np.zeros((n, n)), np.zeros(n), 0.0, 0.0
        # the engine's previous cumulative report: (passes, Σw, its normal equations)
        self.last: tuple[int, float, tuple] | None = None

    def add(self, report: dict, keep_per_pass: float) -> int:
        """Fold in what ``report`` adds to the last one; the passes it adds."""
        last = self.last if self.last is not None and report["n"] >= self.last[0] else None  # restarted
        new = report["n"] - (last[0] if last else 0)
        if new <= 0:
            return 0
        sums = normal_equations(report)
        self.last = (report["n"], report["w"], sums)
        a, b, yty = sums
        w = report["w"] - (last[1] if last else 0.0)
        if last is not None:
            a0, b0, yty0 = last[2]
            a, b, yty = a - a0, b - b0, yty - yty0
        keep = keep_per_pass**new
        # the block's passes came one after another: each is forgotten as far as its place
        # (all of a fresh router's first report, since the engine started, is one block)
        part = (1 - keep) / (new * (1 - keep_per_pass)) if keep_per_pass < 1 else 1.0
        self.a, self.b = self.a * keep + part * a, self.b * keep + part * b
        self.yty, self.w = self.yty * keep + part * yty, self.w * keep + part * w
        return new

    def sse(self, beta: np.ndarray) -> float:
        return max(0.0, self.yty - 2 * float(beta @ self.b) + float(beta @ self.a @ beta))

    def relative_error(self, beta: np.ndarray) -> float | None:
        """RMS relative residual (the engine's sums are of passes divided by their times)."""
        if self.w <= 0:
            return None
        return math.sqrt(self.sse(beta) / self.w)


class OnlineCost:
    def __init__(
        self,
        prior: Prior,
        window_passes: float = 2000.0,
        prior_passes: float = 16.0,
        min_passes: float = 50.0,
        refit_passes: int = 32,
    ) -> None:
        self.prior = prior
        self.keep = math.exp(-1.0 / window_passes)
        self.min_passes, self.refit_passes = min_passes, refit_passes
        self.windows = {"eager": _Window(), "graph": _Window()}
        self.prior_passes = prior_passes
        self._grid = _pseudo_passes(prior.model)
        self._since_fit = 0
        self.outliers = 0
        self.fit = CostFit(prior.model, "prior", prior.label, prior.kind, "no passes yet")

    def observe(self, report: dict) -> bool:
        """Take an engine's pass report; refit when enough passes came. True: ``fit`` changed."""
        for kind, sums in report.items():
            if kind in self.windows:
                self._since_fit += self.windows[kind].add(sums, self.keep)
        self.outliers = sum(int(sums.get("outliers", 0)) for sums in report.values())
        if self._since_fit < self.refit_passes:
            return False
        self._since_fit = 0
        self.fit = self._refit()
        return True

    def _refit(self) -> CostFit:
        eager, prior = self.windows["eager"], self.prior.model
        base = np.array(prior.terms())
        common = {"prior": self.prior.label, "prior_kind": self.prior.kind, "passes": eager.w,
                  "outliers": self.outliers, "prior_error": eager.relative_error(base)}  # fmt: skip
        if eager.w < self.min_passes:
            return CostFit(prior, "prior", reason=f"too few passes ({eager.w:.0f} of {self.min_passes:.0f})",
                           error=common["prior_error"], **common)  # fmt: skip
        if not separable(eager.a):  # the prior's shape, at the scale the passes show
            factor = _scale(eager, base)
            scaled = prior.scaled(factor)
            return CostFit(scaled, "prior", reason="singular design: the window's passes do not tell the "
                           f"base from the per-token costs; the prior ×{factor:.3g} to match them",
                           error=eager.relative_error(np.array(scaled.terms())), **common)  # fmt: skip
        beta = self._solve(eager)
        model = _model(prior, beta, self.prior.label, eager.w)
        graph = self.windows["graph"]
        if graph.w >= self.min_passes and separable(graph.a):  # decodes replaying CUDA graphs
            gb = self._solve(graph)
            model = replace(
                model, decode_ms_per_request=float(gb[2]), attention_ms_per_context_token=float(gb[3])
            )
            step = with_decode_step(replace(model, base_ms=float(gb[0])), *TYPICAL_DECODE).decode_step_ms
            model = replace(model, decode_step_ms=step)
        error = eager.relative_error(np.array(model.terms()))
        if not all(math.isfinite(v) for v in model.terms()) or error is None:
            return CostFit(prior, "prior", reason="the fit is not finite", **common)
        if common["prior_error"] is not None and error > common["prior_error"] + ROUNDING:
            return CostFit(prior, "prior", reason="the fit is no better than the prior",
                           error=common["prior_error"], **common)  # fmt: skip
        return CostFit(model, "learnt", error=error, **common)

    def _solve(self, window: _Window) -> np.ndarray:
        """The window plus the prior as pseudo-passes, each counting as much as the prior
        predicts the window as well as the window's own fit does (empirical Bayes: a prior
        10x off pulls nothing, a good one a few per cent early on): ``prior_passes`` shaped
        like the window's own (Zellner's g-prior: each direction the window exercises is
        pulled to the prior alike, however lopsided its passes), and a grid of
        ``GRID_PASSES`` for the directions it does not exercise yet (there the prior alone
        speaks, at any weight). A term neither exercises keeps the prior's."""
        prior = np.array(self.prior.model.terms())
        own = self._nnls(window, prior, 0.0, FLOOR)
        trust = max(FLOOR, min(1.0, window.sse(own) / max(window.sse(prior), 1e-12)))
        g = self.prior_passes * trust / max(window.w, 1e-9)
        return self._nnls(window, prior, g, GRID_PASSES * trust)

    def _nnls(self, window: _Window, prior: np.ndarray, g: float, grid: float) -> np.ndarray:
        a0, b0, yty0 = _relative(*self._grid, window, grid)
        a = window.a * (1 + g) + a0
        b = window.b + g * window.a @ prior + b0
        yty = window.yty + g * float(prior @ window.a @ prior) + yty0
        beta, _ = nnls(a, b, yty)
        dead = np.diag(a) <= 0
        beta[dead] = prior[dead]
        return beta


def _scale(window: _Window, prior: np.ndarray) -> float:
    """The factor on every prior term that best predicts the window's passes (least
    squares, at least a hundredth): an engine whose passes are all of one shape still
    corrects a prior that is off as a whole (another model's fit, say, 7x cheaper), where
    keeping the prior as it was kept E2 sending that engine work it could not do."""
    predicted = float(prior @ window.a @ prior)
    return max(0.01, float(prior @ window.b) / predicted) if predicted > 0 else 1.0


def _pseudo_passes(prior: CostModel) -> tuple[np.ndarray, np.ndarray]:
    """The prior's passes over a grid of prefills and decode batches (and a copy between
    tiers where it prices one): their rows and the times the prior gives them. The copy
    is one alone, no pass around it: inside a decode pass at the prior's time, the copy
    term was the one left to explain the prior's whole pass where the engine's passes
    never copy, and came out 265x the true cost (tiny engines from SmolLM2's prior)."""
    rows = [row(n, 0, n, 0, prior.num_experts, prior.experts_per_token) for n in PRIOR_PREFILLS]
    rows += [row(0, b, b * c, 0, prior.num_experts, prior.experts_per_token) for b, c in PRIOR_DECODES]
    if prior.load_ms_per_token:
        rows.append((0.0, 0.0, 0.0, 0.0, float(COPY_TOKENS), 0.0))
    x = np.array(rows)
    return x, x @ np.array(prior.terms())


def _relative(x: np.ndarray, y: np.ndarray, window: _Window, weight: float) -> tuple:
    """The grid as ``weight`` passes, each divided by its time as the engines' passes are
    (``pass_costs``), but by no less than the window's typical pass: a prior 10x off that
    prices a decode at 0.05 ms would otherwise make that row a thousand passes."""
    typical = window.w / window.b[0] if window.b[0] > 0 else 1.0  # Σw / Σw·y/s² ≈ harmonic mean
    scale = np.maximum(y, typical)
    x, y, w = x / scale[:, None], y / scale, weight / len(y)
    return w * x.T @ x, w * x.T @ y, w * float(y @ y)


def _model(prior: CostModel, beta: np.ndarray, label: str, passes: float) -> CostModel:
    """The fit as a cost model; DECODETIME's step at ``TYPICAL_DECODE``, as ``preble
    profile`` times it."""
    fit = replace(prior, **{term: float(v) for term, v in zip(TERMS, beta)},
                  source=f"online fit over {passes:.0f} passes (prior: {label})")  # fmt: skip
    return with_decode_step(fit, *TYPICAL_DECODE)
