"""PREFILLTIME and DECODETIME (paper §4.2), and the iteration time the simulator charges.

An iteration that computes ``p`` prefill tokens and ``d`` decodes over ``c`` context
tokens in total takes ``base + p·prefill + d·decode + c·attention`` milliseconds; for a
mixture of experts, plus the expert weights its tokens touch: ``experts_ms · (1 − (1 −
k/E)^(p + d))``, the time to stream every expert once times the expected share of the
``E`` experts that ``p + d`` tokens choosing ``k`` each route to (at batch 1 a Qwen3-MoE
step reads 8 of 128 experts; at 64 nearly all). E2 uses
``PREFILLTIME(n) = base + n·prefill`` and ``DECODETIME(n) = n·decode_step``, where
``decode_step_ms`` is the time of one decode iteration at a typical batch: a request that
generates ``n`` tokens occupies its instance for ``n`` such iterations.

``preble profile`` measures an engine and fits these by least squares (``fit``). Two fits
ship: ``tiny_cpu.json`` (the embedded model on this project's CPU machine) and
``mistral7b_a6000.json`` (the paper's reference numbers, for GPU-scale simulations).
"""

from __future__ import annotations

import itertools
import json
from dataclasses import asdict, dataclass, replace
from pathlib import Path

SHIPPED = Path(__file__).parent / "cost_models"


def expert_share(tokens: int, num_experts: int, top_k: int) -> float:
    """The expected share of ``num_experts`` experts that ``tokens`` tokens choosing ``top_k``
    each read (independently and uniformly: a trained router's skew reads fewer)."""
    if not num_experts or tokens <= 0:
        return 0.0
    return 1.0 - (1.0 - top_k / num_experts) ** tokens


@dataclass(frozen=True)
class CostModel:
    base_ms: float
    prefill_ms_per_token: float
    decode_ms_per_request: float
    attention_ms_per_context_token: float
    decode_step_ms: float
    source: str = ""
    # KV copied between the device and the host tier (engine/cache/host_tier.py), per token,
    # either way: the engine's KV bytes per token over the host link's bandwidth (PCIe
    # moves pinned memory at about the same rate both ways). 0: no tier modelled.
    load_ms_per_token: float = 0.0
    load_source: str = ""
    # A mixture of experts: streaming every expert's weights once, and the routing (E
    # experts, k per token). 0: dense, every weight in ``base_ms``.
    experts_ms: float = 0.0
    num_experts: int = 0
    experts_per_token: int = 0
    # What the fit was measured or modelled for: the model's shape (``model_card.shape_signature``),
    # the device class (``model_card.device_class``) and the tensor-parallel width. A router
    # prices an engine with a shipped fit only where all three match (``scheduler/cost_priors.py``).
    model: str = ""
    device: str = ""
    tensor_parallel: int = 1

    def expert_reads(self, tokens: int) -> float:
        """The expected time to read the experts ``tokens`` tokens route to."""
        return self.experts_ms * expert_share(tokens, self.num_experts, self.experts_per_token)

    def prefill_time(self, tokens: int) -> float:
        if tokens <= 0:
            return 0.0
        return self.base_ms + self.prefill_ms_per_token * tokens + self.expert_reads(tokens)

    def decode_time(self, tokens: float) -> float:
        return self.decode_step_ms * tokens

    def load_time(self, tokens: int) -> float:
        """Bringing ``tokens`` of KV back from the host tier instead of recomputing them."""
        return self.load_ms_per_token * tokens

    def iteration_time(
        self,
        prefill_tokens: int,
        decodes: int,
        context_tokens: int,
        moved_tokens: int = 0,
        ahead_tokens: int = 0,
    ) -> float:
        """The iteration also waits for the copies between tiers that forming it made: the
        load-backs its requests need and the offloads of what it evicted (charged in full:
        the engine overlaps neither with the forward pass). Copies ahead of eviction run
        beside it, and only what outlasts it shows."""
        serial = (
            self.base_ms
            + self.prefill_ms_per_token * prefill_tokens
            + self.decode_ms_per_request * decodes
            + self.attention_ms_per_context_token * context_tokens
            + self.load_ms_per_token * moved_tokens
            + self.expert_reads(prefill_tokens + decodes)
        )
        return max(serial, self.load_ms_per_token * ahead_tokens)

    def scaled(self, factor: float) -> CostModel:
        """Every time ×``factor``: the GPU an emulated engine with that slowdown plays."""
        return replace(
            self,
            base_ms=self.base_ms * factor,
            prefill_ms_per_token=self.prefill_ms_per_token * factor,
            decode_ms_per_request=self.decode_ms_per_request * factor,
            attention_ms_per_context_token=self.attention_ms_per_context_token * factor,
            decode_step_ms=self.decode_step_ms * factor,
            load_ms_per_token=self.load_ms_per_token * factor,
            experts_ms=self.experts_ms * factor,
            source=f"{self.source} (x{factor:g})" if factor != 1 else self.source,
        )

    def terms(self) -> list[float]:
        """The coefficients in ``pass_costs.TERMS`` order."""
        return [self.base_ms, self.prefill_ms_per_token, self.decode_ms_per_request,
                self.attention_ms_per_context_token, self.load_ms_per_token, self.experts_ms]  # fmt: skip

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(asdict(self), indent=2) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> CostModel:
        """A JSON file, or the name of a shipped fit (``tiny_cpu``, ``mistral7b_a6000``)."""
        p = Path(path)
        if not p.is_file() and (SHIPPED / f"{path}.json").is_file():
            p = SHIPPED / f"{path}.json"
        if not p.is_file():
            raise ValueError(f"cost_model={str(path)!r} is invalid: no such file or shipped fit")
        return cls(**json.loads(p.read_text()))


Sample = tuple[int, int, int, float]  # (prefill tokens, decodes, context tokens, milliseconds)


def nnls(a, b, yty: float):
    """Non-negative least squares from the normal equations (``a = XᵀWX``, ``b = XᵀWy``,
    ``yty = yᵀWy``): time never falls with more work. Exact for a handful of terms: the
    best unconstrained fit over every subset of them whose coefficients all come out
    non-negative (terms no row exercises stay 0). Clipping an unconstrained fit at zero is
    not that optimum: on noisy CPU timings it set the base time to 0 and left the other
    coefficients where the negative base had put them. Returns (coefficients, the residual
    sum of squares)."""
    import numpy as np  # here: the CLI's help reads this module, and numpy costs it ~1.7 s

    n = len(b)
    live = [i for i in range(n) if a[i, i] > 0]
    scale = np.sqrt(np.where(np.diag(a) > 0, np.diag(a), 1.0))  # terms span 1 to 10^5 tokens:
    a, b = a / np.outer(scale, scale), b / scale  # solved as correlations, or precision goes
    if live:  # the unconstrained optimum, where it is non-negative, is the answer: one solve
        coef = np.linalg.lstsq(a[np.ix_(live, live)], b[live], rcond=None)[0]
        if np.all(coef >= 0):
            best = np.zeros(n)
            best[live] = coef
            return best / scale, max(yty - float(coef @ b[live]), 0.0)
    best, best_error = np.zeros(n), yty
    for subset in itertools.product((False, True), repeat=len(live)):
        cols = [i for i, keep in zip(live, subset) if keep]
        if not cols:
            continue
        sub = a[np.ix_(cols, cols)]
        coef = np.linalg.lstsq(sub, b[cols], rcond=None)[0]
        if np.any(coef < 0):
            continue
        error = yty - 2 * float(coef @ b[cols]) + float(coef @ sub @ coef)
        if error < best_error - 1e-12 * max(abs(yty), 1.0):
            best, best_error = np.zeros(n), error
            best[cols] = coef
    return best / scale, max(best_error, 0.0)


def fit(samples: list[Sample], decode_step_ms: float, source: str) -> CostModel:
    """``nnls`` of iteration times over the four terms ``preble profile`` varies, each
    timing weighed by its inverse (the relative error is what is minimized). Unweighted,
    an 8 s prefill outweighed every decode: SmolLM2's fit on one core priced a 62 ms decode
    of one request at 7 ms (base 0), and E2 prices mostly decodes."""
    import numpy as np

    x = np.array([[1.0, p, d, c] for p, d, c, _ in samples])
    y = np.array([ms for *_, ms in samples])
    w = 1.0 / np.maximum(y, 1e-9)
    x, y = x * w[:, None], y * w
    best, _ = nnls(x.T @ x, x.T @ y, float(y @ y))
    return CostModel(
        base_ms=float(best[0]),
        prefill_ms_per_token=float(best[1]),
        decode_ms_per_request=float(best[2]),
        attention_ms_per_context_token=float(best[3]),
        decode_step_ms=decode_step_ms,
        source=source,
    )


@dataclass(frozen=True)
class FitQuality:
    r2: float  # the share of the timings' variance the model explains
    median_error: float  # median |predicted - measured| / measured
    max_error: float

    @property
    def poor(self) -> bool:
        return self.r2 < 0.9 or self.median_error > 0.2


def fit_quality(samples: list[Sample], model: CostModel) -> FitQuality:
    import numpy as np

    measured = np.array([ms for *_, ms in samples])
    predicted = np.array([model.iteration_time(p, d, c) for p, d, c, _ in samples])
    spread = float(np.sum((measured - measured.mean()) ** 2))
    r2 = 1.0 - float(np.sum((predicted - measured) ** 2)) / spread if spread > 0 else 1.0
    errors = np.abs(predicted - measured) / np.maximum(measured, 1e-9)
    return FitQuality(r2, float(np.median(errors)), float(errors.max()))
