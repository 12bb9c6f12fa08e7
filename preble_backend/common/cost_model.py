"""PREFILLTIME and DECODETIME (paper §4.2), and the iteration time the simulator charges.

An iteration that computes ``p`` prefill tokens and ``d`` decodes over ``c`` context
tokens in total takes ``base + p·prefill + d·decode + c·attention`` milliseconds. E2 uses
``PREFILLTIME(n) = base + n·prefill`` and ``DECODETIME(n) = n·decode_step``, where
``decode_step_ms`` is the time of one decode iteration at a typical batch: a request that
generates ``n`` tokens occupies its instance for ``n`` such iterations.

``preble profile`` measures an engine and fits these by least squares (``fit``). Two fits
ship: ``tiny_cpu.json`` (the embedded model on this project's CPU machine) and
``mistral7b_a6000.json`` (the paper's reference numbers, for GPU-scale simulations).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import numpy as np

SHIPPED = Path(__file__).parent / "cost_models"


@dataclass(frozen=True)
class CostModel:
    base_ms: float
    prefill_ms_per_token: float
    decode_ms_per_request: float
    attention_ms_per_context_token: float
    decode_step_ms: float
    source: str = ""

    def prefill_time(self, tokens: int) -> float:
        return self.base_ms + self.prefill_ms_per_token * tokens if tokens > 0 else 0.0

    def decode_time(self, tokens: float) -> float:
        return self.decode_step_ms * tokens

    def iteration_time(self, prefill_tokens: int, decodes: int, context_tokens: int) -> float:
        return (
            self.base_ms
            + self.prefill_ms_per_token * prefill_tokens
            + self.decode_ms_per_request * decodes
            + self.attention_ms_per_context_token * context_tokens
        )

    def scaled(self, factor: float) -> CostModel:
        """Every time ×``factor``: the GPU an emulated engine with that slowdown plays."""
        return replace(
            self,
            base_ms=self.base_ms * factor,
            prefill_ms_per_token=self.prefill_ms_per_token * factor,
            decode_ms_per_request=self.decode_ms_per_request * factor,
            attention_ms_per_context_token=self.attention_ms_per_context_token * factor,
            decode_step_ms=self.decode_step_ms * factor,
            source=f"{self.source} (x{factor:g})" if factor != 1 else self.source,
        )

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


def fit(samples: list[tuple[int, int, int, float]], decode_step_ms: float, source: str) -> CostModel:
    """Least-squares fit of iteration times: samples are (prefill tokens, decodes,
    context tokens, milliseconds). Coefficients are clipped at zero (time never falls
    with more work)."""
    x = np.array([[1.0, p, d, c] for p, d, c, _ in samples])
    y = np.array([ms for *_, ms in samples])
    coef, *_ = np.linalg.lstsq(x, y, rcond=None)
    coef = np.clip(coef, 0.0, None)
    return CostModel(
        base_ms=float(coef[0]),
        prefill_ms_per_token=float(coef[1]),
        decode_ms_per_request=float(coef[2]),
        attention_ms_per_context_token=float(coef[3]),
        decode_step_ms=decode_step_ms,
        source=source,
    )
