"""Admission (pure): may a request join the prefill queue, or would it wait past its deadline?

The bubbles serve prefill at a rate: the bubble seconds workers had over the last `window_s` (each
bubble's length, start to its training input's arrival: a worker fills it to the end from the work
it holds), per second. A request arriving behind `ahead_s` of predicted prefill (the queue's, and
all the work already held on workers, which runs first) would start, at that rate, after about
`ahead_s / rate`; if that and its own predicted time end past `1 - MARGIN` of the time left to its
deadline, it is refused now (`FailureReason.OVERLOADED`: the front door answers 429 with
Retry-After), rather than queued to expire there (a 504 after a wait). Past capacity the excess is
turned away early.

Why a margin: past capacity the queue fills up to what admission allows, so the request admitted
last is predicted to finish just at its deadline, and with an unbiased prediction half of such
requests finish after it. With no margin, a 24-iteration `bench/bubble_fill.py --quick` run at
120% of capacity (2026-11-28) refused 1,091 requests with a 429 and let 1,050 expire with a 504;
the admitted requests' TTFT p99 was 1.05 of the objective, the rate's and the cost model's errors
together. `MARGIN` covers that error (docs/benchmarks.md has the run with it).

Until `min_s` of bubbles has been seen (a whole window unless set) there is no rate, and every
request is admitted: a rate over a shorter span refused a restarted dispatcher's backlog, read
before the pipeline's bubbles had come round once (a quarter window was tried on 2026-11-27);
likewise when no bubble came in the window (a
paused pipeline is the readiness gate's call, not admission's). For that reason too the rate is
never below the best a whole window has shown: a pipeline pausing while a lost worker is replaced
announces short bubbles, and its queue is served once it runs again. The best is taken only for
such a pause, a window under `PAUSE_SHARE` of it: a noisy window a little under the best is the
rate (the best of many windows is their noise's maximum, and past capacity it admitted requests
that then expired).

The rate is the bubble time, not what was served: a served rate (tried on 2026-11-27) fell to
nothing while a lost worker was replaced and refused requests the recovered pipeline then had a
minute to serve. The bubble time is optimistic (no prefill runs in the moment a bubble takes to
start, and none past the cost model's error), which lets a few requests in that then expire
(docs/benchmarks.md).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

#: A request is admitted only if it is predicted to finish with this share of its time left before
#: its deadline to spare (see the module docstring).
MARGIN = 0.15
#: A window's rate under this share of the best window's is a pause (a lost worker replaced), not
#: noise: the best stands for it.
PAUSE_SHARE = 0.5


@dataclass
class Admission:
    window_s: float  # real seconds of bubbles the rate is measured over
    #: no rate before this much has been seen (real s; None: the whole window)
    min_s: float | None = None
    #: (when it started, its usable seconds) for the bubbles of the window, oldest first
    _bubbles: deque[tuple[float, float]] = field(default_factory=deque)
    _usable_s: float = 0.0  # the sum of the window's usable seconds
    _first: float | None = None  # when the first bubble was seen
    _best: float = 0.0  # the highest rate over a whole window so far

    def bubble(self, started: float, usable_s: float) -> None:
        """A bubble that opened at `started` offered `usable_s` seconds to prefill."""
        if self._first is None:
            self._first = started
        self._bubbles.append((started, usable_s))
        self._usable_s += usable_s

    def rate(self, now: float) -> float | None:
        """Usable bubble seconds per second (see the module docstring); None before `min_s` was
        seen or when no bubble came in the window."""
        while self._bubbles and self._bubbles[0][0] < now - self.window_s:
            self._usable_s -= self._bubbles.popleft()[1]
        least = self.window_s if self.min_s is None else self.min_s
        if self._first is None or now - self._first < least or not self._bubbles:
            return None
        rate = max(0.0, self._usable_s) / min(self.window_s, now - self._first)
        if now - self._first >= self.window_s:
            self._best = max(self._best, rate)
        return self._best if rate < PAUSE_SHARE * self._best else rate

    def finish_in(self, ahead_s: float, own_s: float, now: float) -> float | None:
        """When a request of `own_s` predicted seconds, arriving behind `ahead_s`, would finish in
        the bubbles (seconds from `now`); None while there is no rate (see `rate`)."""
        rate = self.rate(now)
        return (ahead_s + own_s) / rate if rate else None

    def refusal(self, ahead_s: float, own_s: float, deadline: float | None, now: float) -> str | None:
        """Why a request of `own_s` predicted seconds, arriving behind `ahead_s`, cannot be served
        before `deadline`; None to admit it."""
        rate = self.rate(now)
        if deadline is None or not rate:
            return None
        done_in = (ahead_s + own_s) / rate
        left = deadline - now
        if done_in <= left * (1 - MARGIN):
            return None
        return (
            f"overloaded: {ahead_s:.2f}s of prefill queued ahead and the bubbles serve {rate:.2f}s of it per "
            f"second: it would finish in about {done_in:.2f}s, too close to its deadline in {max(0.0, left):.2f}s"
        )
