"""How long a prefill takes, learned online from workers' reports (pure).

Prefill time for a prompt of T tokens is modelled as ``a + b*T + c*T^2`` seconds (fixed cost,
the linear layers, attention), fitted by exponentially-weighted least squares over recent
reports, one model per device kind. Until reports arrive, a prior fit stands in (a few
pseudo-observations), so the first predictions are sane. Packing uses the mean prediction: an
overrun costs at most one layer, because the worker yields at layer boundaries.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from shared.config.spec import ClusterSpec
from shared.policies.fill import piece_tokens

#: Weight of older reports decays by this factor per new report (memory of ~50 reports).
FORGET = 0.98
#: No prefill is predicted to take less than this (1 microsecond of device time).
MIN_SECONDS = 1e-6
#: A little ridge keeps the 3x3 normal equations solvable with few distinct prompt lengths.
_RIDGE = 1e-12 * np.eye(3)


def _features(tokens: int) -> tuple[float, float, float]:
    t = float(tokens)
    return (1.0, t, t * t)


@dataclass(frozen=True)
class PrefillProfile:
    """What one prefill block (one transformer layer of one prompt) counts for on the emulated
    device: a fixed part (kernel launches, weight reads) plus a part per prompt token (the matmuls;
    attention's T^2 term is small next to them at prompt lengths a bubble takes).

    The device's overheads, which the live worker and the simulator count alike:
    * `piece_tokens`: a layer runs in pieces of this many tokens (`bubbletea.piece_tokens`; None:
      whole layers), each a block of its own, with its own fixed part;
    * `launch_s`: the host's floor per block: one takes at least this long however fast the device,
      as when Python's launch speed, not the GPU, sets the pace of small kernels;
    * `sync_s`: per finished request, reading its first token off the device."""

    fixed_s: float
    per_token_s: float
    launch_s: float = 0.0
    sync_s: float = 0.0
    piece_tokens: int | None = None

    def block_s(self, tokens: int) -> float:
        """One block of `tokens` tokens: a whole layer, or one piece of one."""
        return max(self.fixed_s + self.per_token_s * tokens, self.launch_s)

    def token_s(self, tokens: int) -> float:
        """Of one block of `tokens` tokens, the part that computes them: its time less the fixed
        part and any wait for the launch floor (what useful utilization counts)."""
        return self.per_token_s * tokens

    def pieces(self, tokens: int) -> list[int]:
        """The tokens of each block one layer of a `tokens`-token prompt runs in: whole pieces,
        then what is left."""
        size = self.piece_tokens
        if size is None or tokens <= size:
            return [tokens]
        whole, rest = divmod(tokens, size)
        return [size] * whole + [rest] if rest else [size] * whole

    def layer_s(self, tokens: int) -> float:
        """One layer of a `tokens`-token prompt, all its pieces (summed in order, as they run)."""
        size = self.piece_tokens
        if size is None or tokens <= size:
            return self.block_s(tokens)
        whole, rest = divmod(tokens, size)
        block, total = self.block_s(size), 0.0
        for _ in range(whole):
            total += block
        return total + self.block_s(rest) if rest else total

    def request_s(self, tokens: int, layers: int) -> float:
        """A whole prompt of `tokens` tokens through `layers` layers, its first token read."""
        return layers * self.layer_s(tokens) + self.sync_s

    @classmethod
    def from_device(
        cls,
        fixed_ms: float | None,
        per_token_us: float | None,
        *,
        launch_us: float = 0.0,
        sync_us: float = 0.0,
        piece_tokens: int | None = None,
    ) -> PrefillProfile | None:
        """The spec's `device.prefill_ms_per_layer` / `prefill_us_per_token` (and its overheads,
        `prefill_launch_us` / `prefill_sync_us`, with `bubbletea.piece_tokens`); None when the
        first two are unset (prefill counts for its real compute time)."""
        if fixed_ms is None and per_token_us is None:
            return None
        return cls((fixed_ms or 0.0) / 1000, (per_token_us or 0.0) / 1e6, launch_us / 1e6, sync_us / 1e6, piece_tokens)

    @classmethod
    def of_spec(cls, spec: ClusterSpec, *, on_gpu: bool = False) -> PrefillProfile | None:
        """The spec's prefill profile as its workers count it (pieces as `fill.piece_tokens` picks
        them for a worker `on_gpu` or not)."""
        dev = spec.device
        return cls.from_device(
            dev.prefill_ms_per_layer,
            dev.prefill_us_per_token,
            launch_us=dev.prefill_launch_us,
            sync_us=dev.prefill_sync_us,
            piece_tokens=piece_tokens(spec.bubbletea.piece_tokens, on_gpu=on_gpu),
        )


@dataclass
class PrefillCostModel:
    """Seconds to prefill a whole prompt on one device kind."""

    #: prior: (tokens, seconds) pseudo-observations, e.g. from a start-up measurement
    prior: list[tuple[int, float]] = field(default_factory=lambda: [(16, 0.002), (128, 0.01), (512, 0.05)])
    _xtx: list[list[float]] = field(default_factory=lambda: [[0.0] * 3 for _ in range(3)])
    _xty: list[float] = field(default_factory=lambda: [0.0] * 3)
    _coef: tuple[float, float, float] = (0.0, 0.0, 0.0)
    reports: int = 0
    _stale: bool = False  # observed since the last fit
    #: the least it predicts: `MIN_SECONDS` on the device's clock (stretched with the prior)
    floor_s: float = MIN_SECONDS

    @classmethod
    def scaled(cls, time_scale: float) -> PrefillCostModel:
        """A fresh model whose prior is on a device `time_scale` times slower (the prior is in
        device seconds; reports come in real seconds of the scaled run)."""
        model = cls()
        if time_scale == 1:
            return model
        return cls(prior=[(t, s * time_scale) for t, s in model.prior], floor_s=MIN_SECONDS * time_scale)

    def __post_init__(self) -> None:
        for tokens, seconds in self.prior:
            self._add(tokens, seconds, weight=1.0)
        self._refit()

    def predict(self, tokens: int) -> float:
        """Expected seconds for a whole prompt of `tokens` tokens (never negative)."""
        if self._stale:  # observed since the last fit: one solve for all of them
            self._refit()
        # the fit at (1, t, t^2) (`_features`), written out: the dispatcher asks this for every
        # request it weighs, so it is on the simulator's hot path; the same sums in the same order
        t = float(tokens)
        c0, c1, c2 = self._coef
        fit = c0 + c1 * t + c2 * (t * t)
        return max(fit, self.floor_s)  # a quadratic fit can dip below zero far from its data

    def observe(self, tokens: int, seconds: float) -> None:
        """A worker measured `seconds` for a whole prompt of `tokens` (or scaled from a partial run)."""
        if tokens <= 0 or not math.isfinite(seconds) or seconds <= 0:
            return
        for row in self._xtx:
            for j in range(3):
                row[j] *= FORGET
        self._xty = [v * FORGET for v in self._xty]
        self._add(tokens, seconds, weight=1.0)
        self.reports += 1
        # fitted when next asked (`predict`): a report of many items costs one solve, not one each
        self._stale = True

    def _add(self, tokens: int, seconds: float, weight: float) -> None:
        f = _features(tokens)
        for i in range(3):
            for j in range(3):
                self._xtx[i][j] += weight * f[i] * f[j]
            self._xty[i] += weight * f[i] * seconds

    def _refit(self) -> None:
        self._stale = False
        a = np.array(self._xtx) + _RIDGE
        try:
            c0, c1, c2 = np.linalg.solve(a, np.array(self._xty)).tolist()
        except np.linalg.LinAlgError:
            return  # keep the previous fit
        if math.isfinite(c0) and math.isfinite(c1) and math.isfinite(c2):
            self._coef = (c0, c1, c2)
