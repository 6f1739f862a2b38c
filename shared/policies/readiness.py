"""Serving readiness (pure): can queued prefill be served now, and if not, why not.

BubbleTea serves prefill only inside the bubbles of a training run, so "ready" is a property of
training, not of the HTTP front door: with no training there are no bubbles, and a request would
only wait for its deadline. The dispatcher feeds this gate what it sees (the run's slot leases and
their end markers, read from Redis, and the bubbles it is told about) with the clock; the verdict
goes to the front door, which answers `/ready` and refuses new requests with it, and the dispatcher
fails its queued requests explicitly when the verdict says so.

The verdicts (`ServingState`), first match wins:

* DISABLED: `bubbletea.enabled` is false; nothing fills bubbles.
* SERVING: every slot is held (or done, with at least one still held) by a worker that joined the
  run's current generation (past its set-up: `joined`), and a bubble was announced
  within `unready_after_s`, or the slots were all held less than `unready_after_s` ago (the first
  iteration is still warming up: a request queued now waits at most that long for its bubble).
* PREFILL_FAILED: every slot is held, but every worker stopped taking prefill after its prefill
  model failed batch after batch (`shared.policies.guest`; told by `prefill_off`): training goes on,
  and nothing fills its bubbles. While only some have, the run is SERVING and the reason names them.
* STALLED: every slot is held but no bubble for longer than `unready_after_s`.
* JOINING: training was never seen running, every slot is held, and its workers are still setting
  up (they have not joined: models being built), for less than `unready_after_s` so far. Requests
  are taken and wait for the first bubbles, which open the moment the workers join: queued then,
  they are there when the first bubbles start, which a request sent once training runs cannot be
  (its trip through the front door and the dispatcher takes longer than the first bubble's start).
  A request taken now waits about `unready_after_s` at most, the same bound as the first
  iteration's grace under SERVING. Not one with a TTFT objective: the placement moves it to the
  decoder or refuses it until the first bubble (`prompt_placement.on_arrival`), and a front door
  that states one and has no decoder answers `/ready` 503 meanwhile.
* STARTING: training was never seen running, and not every slot is held, or the workers have been
  setting up for longer than `unready_after_s` (a long set-up, a real checkpoint loading, say: a
  client is told to come back rather than left to its deadline). End markers are not read before
  that: they are left by an earlier life of the same run id (a restarted compose project).

Once training was seen running, a run that no longer holds every slot is:

* FINISHED: every slot ended done (the run trained all its iterations).
* STOPPED: a slot ended on purpose (Ctrl-C, SIGTERM); the reason is the slot's own.
* RECOVERING: a slot lost its worker (its lease expired without an end marker) less than
  `recovery_s` ago, or every slot is held again but not every worker rejoined yet, in a run that
  checkpoints: the run pauses for a replacement and resumes from
  a checkpoint (services/stage_worker/membership/generations.py). Requests already queued are kept: they wait
  for the resumed run's bubbles (a lost worker costs latency, not answers). New ones are refused
  (503, Retry-After 5 s): the replacement may never come (a host lost for good and no spare
  worker), and a request taken then would only wait out its deadline for a 504.
* LOST: a slot ended because of another slot's failure (its reason names the culprit), or a
  slot lost its worker longer ago than that (or in a run that cannot recover).

A slot that is held again after an end marker (a restarted worker) counts as held: the marker is
history. Queued requests are failed in every state but SERVING, RECOVERING, JOINING and STARTING:
while the run is starting they are kept for its first bubbles.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from shared.wire.status import LeaseState, ServingState

#: How long a client is told to wait before retrying (`Retry-After`), per state: a starting run is
#: serving within an iteration or two; a stalled or lost one needs an operator or a restart.
RETRY_AFTER_S: dict[ServingState, int] = {
    ServingState.SERVING: 0,
    ServingState.STARTING: 2,
    ServingState.JOINING: 0,
    ServingState.STALLED: 10,
    ServingState.RECOVERING: 5,
    ServingState.LOST: 30,
    ServingState.STOPPED: 60,
    ServingState.FINISHED: 60,
    ServingState.DISABLED: 300,
    ServingState.PREFILL_FAILED: 60,
}


@dataclass(frozen=True)
class SlotView:
    """One (replica, stage) slot of the run as Redis shows it."""

    name: str  # "r<replica>s<stage>"
    held: bool  # a live lease
    ended: LeaseState | None = None  # its end marker, if any
    reason: str = ""  # the end marker's reason


@dataclass(frozen=True)
class Verdict:
    state: ServingState
    reason: str  # one sentence a client can act on
    retry_after_s: int

    @classmethod
    def of(cls, state: ServingState, reason: str) -> Verdict:
        return cls(state, reason, RETRY_AFTER_S[state])

    @property
    def ready(self) -> bool:
        return self.state.ready

    @property
    def fail_queued(self) -> bool:
        """Whether requests waiting for a bubble should be failed now rather than kept."""
        return self.state not in (
            ServingState.SERVING,
            ServingState.RECOVERING,
            ServingState.JOINING,
            ServingState.STARTING,
        )


#: A bubble start seen while the verdict is not ready asks for a readiness check at once (training
#: runs: say so now, not at the next periodic check), at most this often. Not at every one: where the
#: verdict stays unready while bubbles come (every worker stopped taking prefill; a datacenter's
#: dispatcher whose peer datacenter lost a slot), a check at each of thousands of bubble starts a
#: second (two round trips and a MULTI each) took half of a dispatcher's CPU. A fifth of the periodic
#: interval (`verdicts.READINESS_EVERY_S`, 0.25 s): a run that starts is still told within 50 ms.
BUBBLE_RECHECK_S = 0.05


class ServingGate:
    """Judges readiness from slot views and bubble times; remembers when training was last seen running."""

    def __init__(self, *, run: str, enabled: bool, unready_after_s: float, recovery_s: float = 0.0) -> None:
        """`recovery_s`: how long the run waits for a lost worker's replacement (0: it cannot recover)."""
        self.run, self.enabled, self.unready_after_s, self.recovery_s = run, enabled, unready_after_s, recovery_s
        #: Since when a slot has been missing its worker (None: none is).
        self.lost_since: float | None = None
        self.last_bubble_at: float | None = None
        #: Since when every slot has been held (None: not all held at the last look).
        self.all_held_since: float | None = None
        #: Since when every slot has been held by workers still setting up, before training was
        #: first seen running (None: not so at the last look).
        self.setting_up_since: float | None = None
        #: Whether training was ever seen running (every slot held, or a bubble).
        self.started = False
        #: Workers that stopped taking prefill, and why (`prefill_off`); a worker joining anew is
        #: taken off the list (`prefill_on`).
        self.no_prefill: dict[str, str] = {}
        #: When a bubble start last asked for a check (`recheck_due`; a monotonic clock).
        self._rechecked_at = -BUBBLE_RECHECK_S

    def prefill_off(self, worker: str, why: str) -> None:
        self.no_prefill[worker] = why

    def prefill_on(self, worker: str) -> None:
        self.no_prefill.pop(worker, None)

    def saw_bubble(self, at: float) -> None:
        self.last_bubble_at = at if self.last_bubble_at is None else max(self.last_bubble_at, at)
        self.started = True

    def recheck_due(self, now: float) -> bool:
        """Whether a fresh bubble start, seen while the verdict is not ready, should check readiness
        now (`now`: a monotonic clock): at most every `BUBBLE_RECHECK_S`."""
        if now - self._rechecked_at < BUBBLE_RECHECK_S:
            return False
        self._rechecked_at = now
        return True

    def assess(self, slots: Sequence[SlotView], now: float, *, joined: bool = True) -> Verdict:
        """`joined`: every slot's worker joined the run's current generation (past its set-up, or
        its resumption from a checkpoint); a held slot whose worker has not is not training yet."""
        return Verdict.of(*self._assess(slots, now, joined))

    def _assess(self, slots: Sequence[SlotView], now: float, joined: bool) -> tuple[ServingState, str]:
        if not self.enabled:
            return (
                ServingState.DISABLED,
                "BubbleTea is off in this spec (bubbletea.enabled: false): no bubble is filled",
            )
        held = [s for s in slots if s.held]
        gone = [s for s in slots if not s.held]
        running = bool(held) and all(s.ended is LeaseState.DONE for s in gone)
        if running and not joined:  # every slot held, but its workers still setting up or resuming
            self.lost_since, self.all_held_since = None, None
            if not self.started:
                if self.setting_up_since is None:
                    self.setting_up_since = now
                setting_up_s = now - self.setting_up_since
                if setting_up_s <= self.unready_after_s:
                    return ServingState.JOINING, (
                        f"training of run {self.run} starts once its workers have set up ({len(held)} slots held): "
                        "requests are taken and wait for its first bubbles"
                    )
                return ServingState.STARTING, (
                    f"training of run {self.run} has not started: its workers are setting up ({len(held)} slots held) "
                    f"for {setting_up_s:.0f}s, longer than bubbletea.unready_after_s ({self.unready_after_s:g})"
                )
            if self.recovery_s > 0:
                return ServingState.RECOVERING, (
                    f"run {self.run} is recovering from a lost worker: every slot is held again and its "
                    "workers are rejoining to resume from the last checkpoint; queued requests wait, new ones "
                    "are refused until it resumes"
                )
        if running:
            self.lost_since = self.setting_up_since = None
            if self.all_held_since is None:
                self.all_held_since = now
            self.started = True
            off = [s.name for s in held if s.name in self.no_prefill]
            if off and len(off) == len(held):
                return ServingState.PREFILL_FAILED, (
                    f"run {self.run} trains on, but every worker stopped taking prefill; {off[0]}: "
                    f"{self.no_prefill[off[0]]}"
                )
            quiet_since = max(self.all_held_since, self.last_bubble_at or self.all_held_since)
            quiet_s = now - quiet_since
            if quiet_s <= self.unready_after_s:
                serving = f"run {self.run} is training: {len(held)} slots held"
                if off:
                    serving += f"; {len(off)} of them take no prefill ({', '.join(off)}: {self.no_prefill[off[0]]})"
                return ServingState.SERVING, serving
            return ServingState.STALLED, (
                f"no pipeline bubble announced for {quiet_s:.1f}s (bubbletea.unready_after_s is "
                f"{self.unready_after_s:g}): training of run {self.run} is stalled"
            )
        self.all_held_since = self.setting_up_since = None
        if not self.started:  # end markers before that are an earlier life of the run id: history
            return ServingState.STARTING, (
                f"training of run {self.run} has not started: {len(held)} of {len(slots)} slots held by workers"
            )
        if all(s.ended is LeaseState.DONE for s in slots):
            return ServingState.FINISHED, f"training finished: run {self.run} trained all its iterations"
        for s in gone:
            if s.ended is LeaseState.STOPPED:
                return ServingState.STOPPED, f"training was stopped: {s.reason or f'slot {s.name} stopped'}"
        for s in gone:
            if s.ended is LeaseState.ABORTED:
                return ServingState.LOST, f"training stopped: {s.reason}"
        missing = ", ".join(s.name for s in gone if s.ended is None)
        if self.lost_since is None:
            self.lost_since = now
        if self.recovery_s > 0 and now - self.lost_since <= self.recovery_s:
            return ServingState.RECOVERING, (
                f"slot {missing} lost its worker: run {self.run} pauses until a replacement takes the slot and "
                f"resumes from its last checkpoint (gives up after {self.recovery_s:g}s); queued requests wait, new "
                "ones are refused until a replacement worker comes"
            )
        return ServingState.LOST, f"training stopped: slot {missing} lost its worker (its lease expired)"
