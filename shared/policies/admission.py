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

Until a whole window has been seen, the rate is over the pipeline's first round (`FirstRound`):
from each worker's first bubble to its first of a later iteration at the same point or past it, its
bubble seconds over that span, summed over the workers; there is none until every worker that has
had a bubble has come round once, and a request is admitted meanwhile (one with a TTFT objective
is not: placement moves it to the decoder or refuses it, `prompt_placement.on_arrival`, as it
cannot say when the bubbles would start it; one with a deadline only is). A rate over a shorter
span refused a restarted dispatcher's backlog, read before the pipeline's bubbles had come round
once (a quarter window, tried on 2026-11-27: not whole iterations, it undercounted them); and
waiting a whole window (2 device s: 37 real s at k = 18.5) before the first refusal let a load
seven times the capacity be admitted, and then fail at its objective, in that time (2026-12-01).
With no rate in the window (no bubble came in it) every request is admitted as well (a
paused pipeline is the readiness gate's call, not admission's). For that reason too the rate is
never below the best a whole window has shown: a pipeline pausing while a lost worker is replaced
announces short bubbles, and its queue is served once it runs again. The best is taken only for
such a pause, a window under `PAUSE_SHARE` of it: a noisy window a little under the best is the
rate (the best of many windows is their noise's maximum, and past capacity it admitted requests
that then expired). The best decays, halving every `BEST_HALF_LIFE_S`: a pause (seconds) barely
moves it, but a lasting drop (a datacenter lost) is the rate within minutes, where a best kept for
ever admitted requests at the old capacity and failed them at their objective (issue 62).

The rate is the bubble time, not what was served: a served rate (tried on 2026-11-27) fell to
nothing while a lost worker was replaced and refused requests the recovered pipeline then had a
minute to serve. The bubble time is optimistic (no prefill runs in the moment a bubble takes to
start, none until the worker holding a request has its next bubble, and none past the cost model's
error), which let requests in that then expired: 5-10% of those admitted by `bench/up_overload.py`
at three times the bubbles' capacity (2026-11-29).

So the prediction is corrected by what it got wrong (`waited`): for each request whose predicted
wait was at least `SAMPLE_SHARE` of the time it was given (the ones admission's verdict is close
on), its real wait (to its answer, or to its failure at its due time) over the uncorrected
prediction (`raw_finish_in`: the ratio is the model's error, which a correction does not change;
over the corrected one it would fall to 1 as soon as the correction worked, and undo it); the
`CORRECTION_QUANTILE` of the last `CORRECTION_WINDOW` such ratios, between 1 and `MAX_CORRECTION`,
multiplies every prediction. A queue too long for the real rate shortens until its waits come true.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from shared.policies.recent import Recent

#: A request is admitted only if it is predicted to finish with this share of its time left before
#: its deadline to spare (see the module docstring).
MARGIN = 0.15
#: A window's rate under this share of the best window's is a pause (a lost worker replaced), not
#: noise: the best stands for it.
PAUSE_SHARE = 0.5
#: A request's real wait over its predicted one corrects the prediction only if the predicted wait
#: was at least this share of the time it was given (its objective or deadline from its arrival):
#: with a short queue the wait is for the next bubble, which the rate does not predict and which
#: does not make a request late.
SAMPLE_SHARE = 0.25
#: The correction is this quantile of the last `CORRECTION_WINDOW` ratios, at most `MAX_CORRECTION`.
CORRECTION_QUANTILE = 0.9
CORRECTION_WINDOW = 64
MAX_CORRECTION = 2.0
#: The best window's rate halves every this many device seconds (`Admission.best_half_life_s`):
#: a replacement takes seconds, a datacenter lost is for good.
BEST_HALF_LIFE_S = 60.0


@dataclass
class FirstRound:
    """One worker's first round: from its first bubble (`started`, at `iteration` and `position`)
    to its first bubble of a later iteration at that position or past it (or of any iteration after
    that): whole iterations of its bubbles. `span_s` is None until the round is over."""

    started: float
    iteration: int
    position: int
    usable_s: float  # its bubbles' usable seconds so far, that round-ending one excluded
    span_s: float | None = None

    def bubble(self, started: float, iteration: int, position: int, usable_s: float) -> None:
        if self.span_s is not None:
            return
        later = iteration > self.iteration + 1 or (iteration > self.iteration and position >= self.position)
        if later:
            self.span_s = started - self.started
        else:
            self.usable_s += usable_s

    def rate(self) -> float | None:
        return self.usable_s / self.span_s if self.span_s else None


def iteration_and_position(tag: object) -> tuple[int, int] | None:
    """A bubble's tag as the workers send it, (iteration, position); None for any other tag."""
    if isinstance(tag, tuple) and len(tag) == 2 and all(isinstance(x, int) for x in tag):
        return tag[0], tag[1]
    return None


def predicted_finish_s(ahead_s: float, own_s: float, rate: float | None, correction: float = 1.0) -> float | None:
    """The prediction itself: a request of `own_s` predicted seconds behind `ahead_s` of work,
    served at `rate` bubble seconds per second, finishes in about this many seconds, times the
    `correction` of recent waits (`Admission.correction`); None with no rate. `Admission` predicts
    with it for its one dispatcher, and a front door (`dc_routing`) for each datacenter's."""
    return (ahead_s + own_s) / rate * correction if rate else None


@dataclass
class Admission:
    window_s: float  # real seconds of bubbles the rate is measured over
    best_half_life_s: float = BEST_HALF_LIFE_S  # real seconds (`BEST_HALF_LIFE_S`, stretched)
    #: (when it started, its usable seconds) for the bubbles of the window, oldest first
    _bubbles: deque[tuple[float, float]] = field(default_factory=deque)
    _usable_s: float = 0.0  # the sum of the window's usable seconds
    _first: float | None = None  # when the first bubble was seen
    #: each worker's first round (`FirstRound`), by worker; None once a bubble came without a
    #: (iteration, position) tag, whose round cannot be told
    _rounds: dict[str, FirstRound] | None = field(default_factory=dict)
    #: how many of `_rounds` have no rate yet, and their rates' sum once none is left (None: not
    #: summed since the last round was added; a round that came round never changes). Every
    #: arrival reads the first round's rate: rebuilt from ~1,000 rounds each time, it was most of
    #: an 8,192-GPU simulation's time
    _no_rate: int = 0
    _rounds_sum: float | None = None
    _best: float = 0.0  # the highest rate over a whole window so far, as of `_best_at`
    _best_at: float = 0.0
    #: the recent real waits over the uncorrected predicted ones (`waited`)
    _ratios: Recent = field(default_factory=lambda: Recent(CORRECTION_WINDOW, CORRECTION_QUANTILE))
    _correction: float = 1.0  # from `_ratios`, kept as they change: every arrival reads it
    #: a predecessor's rate (`seed`), used until this one's own first round is measured
    _seed_rate: float | None = None

    def bubble(self, started: float, usable_s: float, worker: str = "", tag: object = None) -> None:
        """A bubble of `worker` that opened at `started` (its `tag`, as the workers send it)
        offered `usable_s` seconds to prefill."""
        if self._first is None:
            self._first = started
        self._bubbles.append((started, usable_s))
        self._usable_s += usable_s
        self._round(worker, started, usable_s, tag)

    def _round(self, worker: str, started: float, usable_s: float, tag: object) -> None:
        if self._rounds is None or self._whole_window(started):
            return
        at = iteration_and_position(tag)
        if at is None:
            self._rounds = None
        elif (r := self._rounds.get(worker)) is None:
            self._rounds[worker] = FirstRound(started, at[0], at[1], usable_s)
            self._no_rate, self._rounds_sum = self._no_rate + 1, None
        elif r.span_s is None:  # a round that is over never changes
            r.bubble(started, at[0], at[1], usable_s)
            if r.rate() is not None:
                self._no_rate -= 1

    def _whole_window(self, now: float) -> bool:
        return self._first is not None and now - self._first >= self.window_s

    def _first_round_rate(self) -> float | None:
        """The pipeline's bubble seconds per second over each worker's first round (None until
        every worker that had a bubble has come round once). Kept as the rounds change: summed
        once every round has its rate, over the workers in order, as the sum over them all."""
        if not self._rounds or self._no_rate:
            return None
        if self._rounds_sum is None:
            self._rounds_sum = sum(r.rate() or 0.0 for r in self._rounds.values())
        return self._rounds_sum

    def came_round(self, now: float) -> bool:
        """Whether the rate is measured: every worker came round once, or a whole window passed,
        or a predecessor's measurement was taken over (`seed`)."""
        return self._whole_window(now) or self._first_round_rate() is not None or self._seed_rate is not None

    def seed(self, rate: float, correction: float) -> None:
        """Start from what another dispatcher measured of the same pipeline (its leader before this
        one): its `rate`, until this one's own first round is measured, and its `correction`, until
        this one's own waits say otherwise. A new leader otherwise refused every request with an
        objective until every worker had come round once (about an iteration)."""
        self._seed_rate = rate if rate > 0 else None
        if self._ratios.quantile() is None:  # no wait of its own seen yet
            self._correction = min(MAX_CORRECTION, max(1.0, correction))

    def rate(self, now: float) -> float | None:
        """Usable bubble seconds per second (see the module docstring): over the first round until a
        whole window was seen; None before that round or when no bubble came in the window."""
        while self._bubbles and self._bubbles[0][0] < now - self.window_s:
            self._usable_s -= self._bubbles.popleft()[1]
        if not self._whole_window(now):  # the first round's; a predecessor's until that is over
            own = self._first_round_rate() if self._bubbles else None
            return own if own is not None else self._seed_rate
        if not self._bubbles:
            return None
        rate = max(0.0, self._usable_s) / self.window_s
        best = self._best * 0.5 ** (max(0.0, now - self._best_at) / self.best_half_life_s)
        if rate >= best:
            self._best, self._best_at, best = rate, now, rate
        return best if rate < PAUSE_SHARE * best else rate

    def waited(self, predicted_s: float, real_s: float, given_s: float) -> None:
        """A request admitted with an uncorrected predicted wait of `predicted_s` (`raw_finish_in`)
        was answered, or failed at its due time, `real_s` after its arrival; it was given `given_s`."""
        if predicted_s <= 0 or predicted_s < SAMPLE_SHARE * given_s:
            return
        self._ratios.add(real_s / predicted_s)
        seen = self._ratios.quantile()
        self._correction = 1.0 if seen is None else min(MAX_CORRECTION, max(1.0, seen))

    def correction(self) -> float:
        """What predictions are multiplied by: how much longer the recent waits were than predicted."""
        return self._correction

    def raw_finish_in(self, ahead_s: float, own_s: float, now: float) -> float | None:
        """`finish_in` before its correction: the work over the bubbles' rate."""
        return predicted_finish_s(ahead_s, own_s, self.rate(now))

    def finish_in(self, ahead_s: float, own_s: float, now: float) -> float | None:
        """When a request of `own_s` predicted seconds, arriving behind `ahead_s`, would finish in
        the bubbles (seconds from `now`); None while there is no rate (see `rate`)."""
        return predicted_finish_s(ahead_s, own_s, self.rate(now), self.correction())

    def refusal(self, ahead_s: float, own_s: float, deadline: float | None, now: float) -> str | None:
        """Why a request of `own_s` predicted seconds, arriving behind `ahead_s`, cannot be served
        before `deadline`; None to admit it."""
        done_in = self.finish_in(ahead_s, own_s, now)
        if deadline is None or done_in is None:
            return None
        rate = self.rate(now)
        left = deadline - now
        if done_in <= left * (1 - MARGIN):
            return None
        return (
            f"overloaded: {ahead_s:.2f}s of prefill queued ahead and the bubbles serve {rate:.2f}s of it per "
            f"second (recent waits {self.correction():.2f}x as long as predicted): it would finish in about "
            f"{done_in:.2f}s, too close to its deadline in {max(0.0, left):.2f}s"
        )
