"""Admission (pure): may a request join the prefill queue, or would it wait past its deadline?

The bubbles serve prefill at a rate: the usable seconds of the bubbles workers announced over the
last `window_s` (each bubble's predicted length less the guard and dispatch overhead), per second;
or, once the bubbles are saturated, what the workers reported running over the window, if less:
packing never fills every usable second (a block must fit; bubbles shorter than one hold none), and
at saturation what was served is what can be. Saturated: requests have waited for a whole window
without a break, or one expired in the queue within it (proof that the usable time promised more
than was served; the dispatcher stages queued work on idle workers, so the queue itself may empty
often under overload).
A request arriving behind `queued_s` of predicted prefill would start, at that rate, after about
`queued_s / rate`; if that and its own predicted time end past its deadline, it is refused now
(`FailureReason.OVERLOADED`: the front door answers 429 with Retry-After), rather than queued to
expire there (a 504 after a wait). Past capacity the excess is turned away early, and what is
admitted is served in time. Until `min_s` of bubbles has been seen there is no rate, and every
request is admitted (until `window_s` has been, the rate is over what was seen: a whole window
before the first refusal let a run's first iterations queue up to their deadlines, and expire);
likewise when no bubble came in the window (a paused pipeline is the readiness gate's call, not
admission's). Bubbles that came but served nothing while requests
waited are a rate of 0: a request with a deadline is refused.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field


@dataclass
class Admission:
    window_s: float  # real seconds of bubbles the rate is measured over
    #: no rate before this much has been seen (real s; None: a quarter of the window)
    min_s: float | None = None
    #: (when it started, its usable seconds) for the bubbles of the window, oldest first
    _bubbles: deque[tuple[float, float]] = field(default_factory=deque)
    _usable_s: float = 0.0  # the sum of the window's usable seconds
    _first: float | None = None  # when the first bubble was seen
    #: (when, seconds) of prefill the workers reported running, over the window
    _served: deque[tuple[float, float]] = field(default_factory=deque)
    _served_s: float = 0.0
    _busy_since: float | None = None  # since when requests have waited, with no empty queue seen
    _expired_at: float | None = None  # when a request last expired in the queue

    def served(self, now: float, seconds: float) -> None:
        """Workers reported running `seconds` of prefill."""
        self._served.append((now, seconds))
        self._served_s += seconds

    def expired(self, now: float) -> None:
        """A request's deadline passed while it waited: the rate promised more than was served."""
        self._expired_at = now

    def queue(self, waiting: bool, now: float) -> None:
        """Whether requests wait now (seen at each input: saturation is a queue that never empties)."""
        if not waiting:
            self._busy_since = None
        elif self._busy_since is None:
            self._busy_since = now

    def bubble(self, started: float, usable_s: float) -> None:
        """A bubble opened at `started` offering `usable_s` seconds to prefill."""
        if self._first is None:
            self._first = started
        self._bubbles.append((started, usable_s))
        self._usable_s += usable_s

    def rate(self, now: float) -> float | None:
        """Prefill seconds the bubbles serve per second (see the module docstring); None before a
        whole window was seen or when no bubble came in it."""
        while self._bubbles and self._bubbles[0][0] < now - self.window_s:
            self._usable_s -= self._bubbles.popleft()[1]
        while self._served and self._served[0][0] < now - self.window_s:
            self._served_s -= self._served.popleft()[1]
        least = self.window_s / 4 if self.min_s is None else self.min_s
        if self._first is None or now - self._first < least or not self._bubbles:
            return None
        span = min(self.window_s, now - self._first)
        usable = max(0.0, self._usable_s) / span
        busy = self._busy_since is not None and now - self._busy_since >= span
        if busy or (self._expired_at is not None and now - self._expired_at <= self.window_s):
            return min(usable, max(0.0, self._served_s) / span)  # saturated: what is served
        return usable

    def refusal(self, queued_s: float, own_s: float, deadline: float | None, now: float) -> str | None:
        """Why a request of `own_s` predicted seconds, arriving behind `queued_s`, cannot be served
        before `deadline`; None to admit it."""
        rate = self.rate(now)
        if deadline is None or rate is None:
            return None
        if rate <= 0:
            return (
                f"overloaded: {queued_s:.2f}s of prefill queued ahead and the bubbles served none of it in the "
                f"last {self.window_s:.2f}s"
            )
        done_in = (queued_s + own_s) / rate
        if now + done_in <= deadline:
            return None
        return (
            f"overloaded: {queued_s:.2f}s of prefill queued ahead and the bubbles serve {rate:.2f}s of it per "
            f"second: it would finish in about {done_in:.2f}s, past its deadline in {max(0.0, deadline - now):.2f}s"
        )
