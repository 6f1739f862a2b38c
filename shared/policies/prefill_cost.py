"""How long a prefill takes, learned online from workers' reports (pure).

Prefill time for a prompt of T tokens is modelled as ``a + b*T + c*T^2`` seconds (fixed cost,
the linear layers, attention), fitted by exponentially-weighted least squares over recent
reports, one model per device kind. Until reports arrive, a prior fit stands in (a few
pseudo-observations), so the first predictions are sane. Predictions for packing are
conservative: the fit plus a margin of the recent relative error, so a bubble is rarely overrun.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

#: Weight of older reports decays by this factor per new report (memory of ~50 reports).
FORGET = 0.98
#: Conservative prediction = fit x (1 + SAFETY x recent relative error).
SAFETY = 2.0
#: No prefill is predicted to take less than this (1 microsecond).
MIN_SECONDS = 1e-6


def _features(tokens: int) -> tuple[float, float, float]:
    t = float(tokens)
    return (1.0, t, t * t)


@dataclass
class PrefillCostModel:
    """Seconds to prefill a whole prompt on one device kind."""

    #: prior: (tokens, seconds) pseudo-observations, e.g. from a start-up measurement
    prior: list[tuple[int, float]] = field(default_factory=lambda: [(16, 0.002), (128, 0.01), (512, 0.05)])
    _xtx: list[list[float]] = field(default_factory=lambda: [[0.0] * 3 for _ in range(3)])
    _xty: list[float] = field(default_factory=lambda: [0.0] * 3)
    _rel_err: float = 0.25  # recent relative error (EWMA); starts pessimistic
    _coef: tuple[float, float, float] = (0.0, 0.0, 0.0)
    reports: int = 0

    def __post_init__(self) -> None:
        for tokens, seconds in self.prior:
            self._add(tokens, seconds, weight=1.0)
        self._refit()

    def predict(self, tokens: int) -> float:
        """Expected seconds for a whole prompt of `tokens` tokens (never negative)."""
        f = _features(tokens)
        fit = sum(c * x for c, x in zip(self._coef, f, strict=True))
        return max(fit, MIN_SECONDS)  # a quadratic fit can dip below zero far from its data

    def predict_safe(self, tokens: int) -> float:
        return self.predict(tokens) * (1 + SAFETY * self._rel_err)

    def observe(self, tokens: int, seconds: float) -> None:
        """A worker measured `seconds` for a whole prompt of `tokens` (or scaled from a partial run)."""
        if tokens <= 0 or not math.isfinite(seconds) or seconds <= 0:
            return
        predicted = self.predict(tokens)
        if predicted > 0:
            self._rel_err = 0.9 * self._rel_err + 0.1 * abs(seconds - predicted) / predicted
        for row in self._xtx:
            for j in range(3):
                row[j] *= FORGET
        self._xty = [v * FORGET for v in self._xty]
        self._add(tokens, seconds, weight=1.0)
        self.reports += 1
        self._refit()

    def relative_error(self) -> float:
        return self._rel_err

    def _add(self, tokens: int, seconds: float, weight: float) -> None:
        f = _features(tokens)
        for i in range(3):
            for j in range(3):
                self._xtx[i][j] += weight * f[i] * f[j]
            self._xty[i] += weight * f[i] * seconds

    def _refit(self) -> None:
        # A little ridge keeps the 3x3 normal equations solvable with few distinct prompt lengths.
        a = np.array(self._xtx) + 1e-12 * np.eye(3)
        try:
            sol = np.linalg.solve(a, np.array(self._xty))
        except np.linalg.LinAlgError:
            return  # keep the previous fit
        if np.all(np.isfinite(sol)):
            self._coef = (float(sol[0]), float(sol[1]), float(sol[2]))
