"""Which dispatcher leads a run (pure): one leader, the others standbys, a deposed leader fenced.

One dispatcher may run a run: its credit and queue are one state machine, and two would give the
same worker credit twice. Production starts a second one anyway (a Deployment's rolling update, an
orchestrator restarting one it takes for dead while it is only stalled), so the run's dispatchers
share a lease: a Redis key (`keys.dispatcher_lease_key`) holding the leader's name with a TTL
(`ttl_s`) that the leader renews every `renew_every_s`.

Each step, the shell (services/dispatcher/lease.py) runs the script its role picks (a leader's
compare-and-renew; a standby's take: SET when nobody holds the key, or when it is its own), which
returns the lease as it left it (`Seen`). `Leadership.decide` turns that into a `Decision`, with
its why and when to step again:

* `LEAD`: a standby took the lease. It starts a term, from nothing, as a freshly started
  dispatcher does.
* `KEEP`: the leader renewed it (or Redis did not answer, and the lease it counts is not over).
* `STAND_BY`: another holds it. Look again when its lease would end (a renewal interval at most),
  and take it then if it was not renewed.
* `STEP_DOWN`: the leader found the key gone or another's, or no renewal of its was confirmed
  within its lease (a stall: a GC pause, SIGSTOP, a VM pause; or Redis away): it stops
  dispatching at once and waits as a standby. Its state is history: a new term starts afresh.

**The lease as the leader counts it.** A step Redis confirms holds the lease until the step's send
time plus the time it had left: Redis set that TTL no earlier than the step was sent. The leader
acts only while `leads(now)`, `margin_s` short of that end (its acks, checked against it here,
reach Redis within milliseconds of the check). So a leader stalled past its lease steps down at
its first step after it resumes, whatever Redis says then: what it decided meanwhile was not
written, and its state no longer agrees with the workers'. Its writes to the workers are fenced in
Redis as well (they check the key's value in the same atomic step), which covers a clock that did
not see the stall.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass

from shared.wire.status import DispatcherRole

#: A leader stops acting this long before its lease could end in Redis: its acks, checked against
#: the lease here and sent a moment later (`shared.bus.acks.GATHER_S`), must land while it holds it.
MARGIN_S = 0.25
#: After Redis did not answer, step again this soon (the shell backs off further while it stays away).
RETRY_S = 0.1
#: A standby looks at an expiring lease this long after its end, not before (no busy loop at 0).
AFTER_END_S = 0.005


class Move(enum.StrEnum):
    LEAD = "lead"  # the lease is ours now: start a term
    KEEP = "keep"  # still ours: go on leading
    STAND_BY = "stand_by"  # another's (or unknown): read nothing, dispatch nothing
    STEP_DOWN = "step_down"  # ours no longer: stop dispatching now


@dataclass(frozen=True)
class Seen:
    """The lease as one step left it: its holder (None: nobody), how long it has left (s), and
    when the step was sent (the caller's monotonic clock)."""

    holder: str | None
    left_s: float
    sent_at: float


@dataclass(frozen=True)
class Decision:
    move: Move
    why: str
    look_in_s: float  # when to take the next step
    leader: str | None = None  # who leads, as far as this step saw (None: nobody, or not known)


class Leadership:
    """One dispatcher's view of its run's lease, over its steps (pure: `now` is given)."""

    def __init__(self, me: str, *, ttl_s: float, renew_every_s: float, margin_s: float = MARGIN_S) -> None:
        if not 0 < renew_every_s < ttl_s - margin_s:
            raise ValueError(f"a lease of {ttl_s} s renewed every {renew_every_s} s leaves no time to renew it")
        self.me, self.ttl_s, self.renew_every_s, self.margin_s = me, ttl_s, renew_every_s, margin_s
        self.role = DispatcherRole.STANDBY
        self._until = -math.inf  # ours (as counted here) until then
        self._confirmed = -math.inf  # when the last step that confirmed it was sent

    def leads(self, now: float) -> bool:
        """Whether this dispatcher may act as the leader now."""
        return self.role is DispatcherRole.LEADER and now < self._until

    def decide(self, seen: Seen | None, now: float) -> Decision:
        """What the step that saw `seen` means (None: Redis did not answer it)."""
        if self.role is DispatcherRole.LEADER:
            return self._as_leader(seen, now)
        return self._as_standby(seen, now)

    def step_down(self, why: str) -> Decision:
        """Stop leading now, for `why` (a step's, or the shell's: Redis refused a fenced write).
        The next step comes at once: the lease may be free, and a new term can start."""
        self.role, self._until = DispatcherRole.STANDBY, -math.inf
        return Decision(Move.STEP_DOWN, why, 0.0)

    def _as_leader(self, seen: Seen | None, now: float) -> Decision:
        if now >= self._until:
            return self.step_down(
                f"no renewal confirmed for {now - self._confirmed:.2f} s, past its lease of {self.ttl_s:g} s "
                f"(less {self.margin_s:g} s): another may lead by now"
            )
        if seen is None:
            left = self._until - now
            why = f"Redis did not answer; the lease is ours for {left:.2f} s more"
            return Decision(Move.KEEP, why, min(RETRY_S, left), self.me)
        if seen.holder == self.me:
            self._hold(seen)
            return Decision(Move.KEEP, f"renewed for {seen.left_s:g} s", self.renew_every_s, self.me)
        if seen.holder is None:
            return self.step_down("the lease expired before it was renewed")
        return self.step_down(f"{seen.holder} holds the lease")

    def _as_standby(self, seen: Seen | None, now: float) -> Decision:
        if seen is None:
            return Decision(Move.STAND_BY, "Redis did not answer", RETRY_S)
        if seen.holder == self.me:
            self._hold(seen)
            if now >= self._until:  # the take's reply came too late to act on (a stall mid-step)
                return Decision(Move.STAND_BY, "took the lease, but heard so only past its end", 0.0)
            self.role = DispatcherRole.LEADER
            return Decision(Move.LEAD, f"took the lease for {seen.left_s:g} s", self.renew_every_s, self.me)
        if seen.holder is None:  # it ended between the take's look and now: take it
            return Decision(Move.STAND_BY, "nobody holds the lease", 0.0)
        left = seen.left_s if seen.left_s > 0 else self.renew_every_s  # (no TTL: look a renewal later)
        why = f"{seen.holder} leads (its lease ends in {seen.left_s:.2f} s unless renewed)"
        return Decision(Move.STAND_BY, why, min(left + AFTER_END_S, self.renew_every_s), seen.holder)

    def _hold(self, seen: Seen) -> None:
        self._confirmed = seen.sent_at
        self._until = seen.sent_at + seen.left_s - self.margin_s
