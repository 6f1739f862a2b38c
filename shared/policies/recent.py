"""The recent values of something measured, and the quantile that predicts the next one (pure).

Used where a policy predicts from what it saw lately: the decoder's time to a first token and the
front door's own hops (`prompt_placement`), admission's error (`admission`). The quantile is the
value at rank `int(q * n)` of the `n` kept, sorted (the largest at q near 1): a value seen, never
one interpolated between two.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field


@dataclass
class Recent:
    """The last `window` values seen, and within `horizon_s` of `now` when one is given (None: no
    age limit), with their `q` quantile."""

    window: int
    q: float
    horizon_s: float | None = None
    _seen: deque[tuple[float, float]] = field(default_factory=deque)  # (when, value), oldest first

    def add(self, value: float, at: float = 0.0) -> None:
        """`value` seen at `at` (any clock the caller's `now` shares; only a horizon reads it)."""
        self._seen.append((at, value))
        while len(self._seen) > self.window:
            self._seen.popleft()

    def quantile(self, now: float | None = None) -> float | None:
        """The `q` quantile of what is kept (values older than the horizon dropped first), or None
        when nothing is."""
        if self.horizon_s is not None and now is not None:
            while self._seen and self._seen[0][0] < now - self.horizon_s:
                self._seen.popleft()
        if not self._seen:
            return None
        values = sorted(value for _, value in self._seen)
        return values[min(len(values) - 1, int(self.q * len(values)))]
