"""Routing across datacenters (pure): which datacenter's dispatcher a front door sends a request to.

With a dispatcher per datacenter (DC), each owns its DC's workers' bubbles, credit and request
queue, and publishes a `DcSnapshot` every `PUBLISH_EVERY_S` (its tick; `publish_every_s`): whether it can
serve (its readiness verdict), admission's prediction inputs (the prefill queued ahead of a new
request, its queue's and the work held on its workers; the bubbles' recent rate and the correction
of recent waits; whether its pipeline came round once) and when it was published. `route` places a
request on the DC that is predicted to finish it soonest, by admission's own arithmetic
(`admission.predicted_finish_s`: the queued work and the request's own over the rate, corrected):

* **Only a fresh snapshot of a DC that can serve is used.** One older than `STALE_AFTER_S` (three
  publishes: a dispatcher missed two in a row, it is stopped, stalled or cut off) says nothing of
  now; a DC whose verdict refuses (training finished, stopped, stalled) serves nothing.
* **A DC with no rate is predicted at the slowest measured DC's.** With a TTFT objective, a DC
  before its first bubble or before its pipeline came round once (`Admission.came_round`) is not
  used at all: nothing says when it would start the request (`prompt_placement.on_arrival`'s rule).
  Otherwise (no objective; or a DC that came round but saw no bubble in its window: paused) it is
  taken to serve at the slowest rate another DC measured. Ranked behind every DC with a rate
  instead, it got no request until its first round was over: the first stages' DC comes round last
  (its first bubble is the first iteration's cool-down), and its bubbles of the second iteration ran
  63% full where the others' ran 90-92% (80% with this rule; 512 GPUs, load 1.0, no objective,
  2026-12-06). When no DC has a rate, the least queued is taken (placement assumes the bubbles meet
  the objective then).
* **Soonest, then least queued, then name**: ties are broken the same way on every front door.
* **The objective**: the chosen DC must finish the request within the objective less what
  placement keeps (`prompt_placement.kept_s`: the decoder's reserve, or admission's margin). When no
  DC is predicted to, the route says so (`RouteWhy.NONE_MEETS`) and the caller applies placement's
  rule: the decoder, or a refusal. The DC's dispatcher judges the request again on arrival with
  its own, current state: the route only picks where it is judged.

**Counted locally, and aged, until the next snapshot** (`Router`). Between two publishes a front
door routes many requests on the same snapshot; by the snapshot alone every one of them would go to
the DC that looked emptiest then, and a burst would pile onto it while the others stood idle. So a
request routed to a DC is added to that DC's queued work (its predicted seconds) in the front door's
view, until a snapshot published after it was routed replaces the view (that one counts it). A
request routed within a bus hop before a publish reached its dispatcher after it and is counted by
neither: a hop's worth of arrivals under-counted, none counted twice. And the view is aged: what
was queued drains at the rate the bubbles serve it (`DcSnapshot.aged`). Counted without draining,
the work a load sends between two snapshots piled up in the view: at the demo's capacity, with a
200 ms objective, 70% of the requests sent were refused, 48% at the front door as no DC would meet
it (aged: 48%, 19% at the front door; each request drained from when it was routed, `DcSnapshot.aged`:
45%, 16%, 2026-12-07), where one dispatcher refused 21% (`bubbletea simulate
--dispatch per-dc`, 2026-12-06). Each front door counts only its own requests: with several, each
sees the others' only at the next snapshot.

Tested by tests/unit/test_dc_routing.py; the simulator's per-DC dispatch (`sim/front_door.py`)
feeds it as the live front door would.
"""

from __future__ import annotations

import enum
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field, replace

from shared.policies.admission import Admission, predicted_finish_s
from shared.policies.dispatch_inputs import TICK_S
from shared.policies.prompt_placement import kept_s

#: A DC's dispatcher publishes its snapshot this often (device s), and front doors read them as
#: often: every tick of its timer (`dispatch_inputs.TICK_S`), and live at least every readiness
#: interval (`publish_every_s`). At 250 ms, a snapshot was too old when used: a DC's bubbles come in
#: one lump an iteration, and one taken before the lump sends work elsewhere (the simulator, 512 and
#: 2,048 GPUs at load 1.0 with a 1 s objective: fill 0.81-0.82 and SLO 0.79-0.80 at 250 ms, 0.88 /
#: 0.86 at 50 ms as with one dispatcher; docs/benchmarks.md, 2026-12-06).
PUBLISH_EVERY_S = TICK_S
#: A snapshot older than this (real s) is not used: three readiness intervals
#: (`shared.control.verdicts.READINESS_EVERY_S`, a test pins that they agree; a policy imports no
#: Redis), so that a few lost or late writes (a reconnect, a slow poll, a loaded host) do not take a
#: DC out of the routing, and a dispatcher that stopped does.
STALE_AFTER_S = 0.75


def publish_every_s(time_scale: float, readiness_every_s: float) -> float:
    """How often, in real seconds, a live dispatcher publishes its snapshot and a front door reads
    them at the device time scale `time_scale`: every `PUBLISH_EVERY_S` device seconds, and at least
    every readiness interval (`readiness_every_s`; on a slowed host the tick is longer)."""
    return min(PUBLISH_EVERY_S * time_scale, readiness_every_s)


@dataclass(frozen=True)
class DcSnapshot:
    """What one DC's dispatcher publishes for the front doors."""

    dc: str
    ready: bool  # its readiness verdict: it can serve prefill
    ahead_s: float  # predicted prefill seconds ahead of a new request: its queue's and its workers' held work
    rate: float | None  # its bubbles' usable seconds per second (`Admission.rate`); None: no bubble in its window
    at: float  # when it was published
    correction: float = 1.0  # `Admission.correction`: how much longer recent waits were than predicted
    started: bool = True  # a bubble was seen: training runs in this DC
    came_round: bool = True  # `Admission.came_round`: its rate is measured

    @classmethod
    def of(cls, dc: str, ready: bool, admission: Admission, ahead_s: float, started: bool, now: float) -> DcSnapshot:
        """What a dispatcher owning `dc` publishes (`DispatchState.snapshot`): its verdict, and what its
        `admission` would judge a request arriving now on, behind `ahead_s` (its queue's and its
        workers' held work, as `refusals.on_arrival` counts it); `started`: it has seen a bubble."""
        rate, correction = admission.rate(now), admission.correction()
        return cls(dc, ready, ahead_s, rate, now, correction, started, admission.came_round(now))

    def aged(self, now: float, added: Iterable[tuple[float, float]] = ()) -> DcSnapshot:
        """This snapshot as of `now`, with the work `added` since ((when, predicted seconds), oldest
        first): the queue drains at the rate the bubbles serve it (the rate over the correction, as
        `finish_in` counts it), what was queued from the publish and what was added from when it
        was. Drained as one sum, a burst sent to an idle DC was drained before it was sent: a DC's
        queue counted nothing of it, and every request of a burst went to the DC with the faster
        rate (the live e2e test, 8 of 8 to one DC, 2026-12-07)."""
        t, queued = self.at, self.ahead_s
        for when, seconds in added:
            t, queued = self.add(t, queued, when, seconds)
        return self.as_of(now, t, queued)

    @property
    def drain_rate(self) -> float:
        """Queued seconds its bubbles serve a second (the rate over the correction; 0: no rate)."""
        return self.rate / self.correction if self.rate else 0.0

    def add(self, t: float, queued: float, when: float, seconds: float) -> tuple[float, float]:
        """The queue `queued` as of `t`, drained to `when`, with `seconds` added then: (when, queued)."""
        when = max(when, t)
        return when, max(0.0, queued - (when - t) * self.drain_rate) + seconds

    def as_of(self, now: float, t: float, queued: float) -> DcSnapshot:
        """This snapshot with its queue `queued` as of `t`, drained to `now`."""
        queued = max(0.0, queued - max(0.0, now - t) * self.drain_rate)
        return self if queued == self.ahead_s else replace(self, ahead_s=queued)

    def finish_in(self, own_s: float) -> float | None:
        """When this DC would finish a request of `own_s` predicted seconds (from its publish)."""
        return predicted_finish_s(self.ahead_s, own_s, self.rate, self.correction)


class RouteWhy(enum.StrEnum):
    """Why a request went where it did (a value on the log line and in the simulator's counts)."""

    SOONEST = "soonest"  # the DC predicted to finish it soonest (within its objective, if any)
    ASSUMED = "assumed"  # the same, a DC with no rate measured yet, predicted at the slowest DC's rate
    UNPREDICTED = "unpredicted"  # no usable DC has a prediction (no rate): the least queued, assumed to meet it
    NONE_MEETS = "none_meets"  # no DC is predicted to finish it by its objective: the decoder, or a refusal
    NOT_ROUND = "not_round"  # an objective, and no usable DC has come round once: nothing says when
    NONE_FRESH = "none_fresh"  # no fresh snapshot of a DC that can serve


@dataclass(frozen=True)
class Route:
    """A routing decision: `dc` (None: no DC takes it; `why` says what the caller does) and, where a
    DC was weighed, the soonest one's predicted finish (seconds from now) and a sentence."""

    dc: str | None
    why: RouteWhy
    finish_in_s: float | None = None
    detail: str = ""


def usable(snapshots: Iterable[DcSnapshot], now: float, stale_after_s: float = STALE_AFTER_S) -> list[DcSnapshot]:
    """The snapshots a front door may route on at `now`: fresh ones of DCs that can serve."""
    return [s for s in snapshots if s.ready and now - s.at <= stale_after_s]


def route(
    snapshots: Iterable[DcSnapshot],
    request_cost: float,
    objective_s: float | None,
    now: float,
    *,
    may_move: bool = False,
    decoder_s: float = 0.0,
    stale_after_s: float = STALE_AFTER_S,
) -> Route:
    """Where a request of `request_cost` predicted seconds, arriving at `now` with a TTFT objective
    of `objective_s` (None: none) goes, by the DCs' `snapshots` (see the module docstring).
    `may_move` and `decoder_s` are placement's (`prompt_placement.kept_s`): what of the objective
    is kept from the bubbles."""
    fresh = usable(snapshots, now, stale_after_s)
    if not fresh:
        return Route(None, RouteWhy.NONE_FRESH, detail="no fresh snapshot of a datacenter that can serve")
    if objective_s is not None:
        fresh = [s for s in fresh if s.started and s.came_round]
        if not fresh:
            return Route(None, RouteWhy.NOT_ROUND, detail="no datacenter's pipeline has come round once yet")
    timed = _predicted(fresh, request_cost)
    if not timed:  # no rate anywhere: paused, or before any window (placement assumes they meet it)
        best = min(fresh, key=lambda s: (s.ahead_s, s.dc))
        return Route(best.dc, RouteWhy.UNPREDICTED, detail=f"no rate measured; {best.ahead_s:.3f}s queued there")
    finish, best = min(timed, key=lambda fs: (fs[0], fs[1].ahead_s, fs[1].dc))
    why = RouteWhy.SOONEST if best.rate else RouteWhy.ASSUMED
    if objective_s is None:
        return Route(best.dc, why, finish, f"finishes it in about {finish:.3f}s")
    room = objective_s - kept_s(objective_s, may_move, decoder_s)
    if finish <= room:
        return Route(best.dc, why, finish, f"finishes it in about {finish:.3f}s, {room:.3f}s allowed")
    detail = f"the soonest, {best.dc}, would finish it in about {finish:.3f}s; {max(0.0, room):.3f}s allowed"
    return Route(None, RouteWhy.NONE_MEETS, finish, detail)


def _predicted(fresh: list[DcSnapshot], request_cost: float) -> list[tuple[float, DcSnapshot]]:
    """Each DC's predicted finish; a DC with no rate is predicted at the slowest measured one's."""
    rates = [s.rate for s in fresh if s.rate]
    if not rates:
        return []
    slowest = min(rates)
    return [(predicted_finish_s(s.ahead_s, request_cost, s.rate or slowest, s.correction) or 0.0, s) for s in fresh]


@dataclass
class Router:
    """A front door's view of the DCs: the newest snapshot of each, aged to now, with what it routed
    there since counted into it (see the module docstring: counted locally until the next snapshot)."""

    stale_after_s: float = STALE_AFTER_S
    _latest: dict[str, DcSnapshot] = field(default_factory=dict)  # as published, by DC
    #: per DC, what was routed there since its snapshot's publish (when, predicted seconds), oldest
    #: first (only while its snapshot is fresh: at most `stale_after_s` of them), and its queue with
    #: them added, as of the last (`DcSnapshot.add`: one step a request, not a pass over them all)
    _routed: dict[str, deque[tuple[float, float]]] = field(default_factory=dict)
    _queued: dict[str, tuple[float, float]] = field(default_factory=dict)

    def published(self, snap: DcSnapshot) -> None:
        """A DC's snapshot was read; an older one than the view holds changes nothing. What was
        routed there before its publish is in it (it reached the dispatcher first) and is no longer
        counted here; what was routed since is."""
        held = self._latest.get(snap.dc)
        if held is not None and held.at >= snap.at:
            return
        self._latest[snap.dc] = snap
        routed = self._routed.setdefault(snap.dc, deque())
        while routed and routed[0][0] <= snap.at:
            routed.popleft()
        t, queued = snap.at, snap.ahead_s
        for when, seconds in routed:
            t, queued = snap.add(t, queued, when, seconds)
        self._queued[snap.dc] = (t, queued)

    def view(self, now: float) -> list[DcSnapshot]:
        """Each DC's newest snapshot as of `now` (`DcSnapshot.aged`), with the work routed there since
        its publish added to its queue."""
        return [s.as_of(now, *self._queued[dc]) for dc, s in self._latest.items()]

    def judged_by(self, now: float) -> str | None:
        """Where the live front door sends a request no DC was routed for (`route` gave none), so
        that a DC's dispatcher judges it with its own, current state, as one dispatcher judges
        every request (placement's rule: the decoder, or a 429): the least queued fresh DC that can
        serve, by name on a tie (None: none fresh; the front door takes the DCs in turn)."""
        fresh = usable(self.view(now), now, self.stale_after_s)
        return min(fresh, key=lambda s: (s.ahead_s, s.dc)).dc if fresh else None

    def route(
        self,
        request_cost: float,
        objective_s: float | None,
        now: float,
        *,
        may_move: bool = False,
        decoder_s: float = 0.0,
    ) -> Route:
        """`route` over the view; a request routed to a DC is counted there until its next snapshot."""
        r = route(
            self.view(now),
            request_cost,
            objective_s,
            now,
            may_move=may_move,
            decoder_s=decoder_s,
            stale_after_s=self.stale_after_s,
        )
        if r.dc is not None:
            self._routed.setdefault(r.dc, deque()).append((now, request_cost))
            self._queued[r.dc] = self._latest[r.dc].add(*self._queued[r.dc], now, request_cost)
        return r
