"""Is a slot's holder gone, before its lease says so? (issue 49: "spares that are ready")

A slot lease is a TTL key its worker renews every `renew_every_s`; a worker that dies without a word
frees its slot only when the key expires (`LEASE_TTL_MS`), so a spare waiting for the slot waits that
long. A killed process tells Redis sooner: the kernel closes its connections, and every connection of
a stage worker carries its holder's name (CLIENT SETNAME). So a holder is taken for gone when all of
these hold:

* none of its connections is open (CLIENT LIST);
* it has not renewed its lease for longer than a renewal interval plus `grace_s`: a live worker whose
  connections were closed under it (a server-side idle timeout, a brief network drop) reconnects at
  its next renewal, and shows up again;
* Redis has been up for `settle_s` at least: after a restart (with an append-only file the leases
  survive it) every client reconnects with backoff, and none is gone for lacking a connection then.

And a spare acts only on **two looks a renewal interval apart** (`HolderWatch`), the holder gone in
both with no renewal between: one look can catch a live worker between a connection closed under it
and its reconnect, plus a stall (a GC pause, a block run on its event loop, a graph capture) of the
0.3 s grace; two cannot unless the stall outlasts a whole renewal interval more. The settle window
also starts again when the spare itself reconnects, or sees another Redis server (a failover: the
new primary's uptime says nothing of its clients'), and a spare that cannot see its own connection
in CLIENT LIST (a proxy, a cluster) turns the check off (`sees_itself`): there, nobody's would show.

A dead host closes nothing (no FIN reaches Redis): its workers' slots free at the TTL, as before.
Pure: the caller reads Redis and passes what it saw, with its clock.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

#: Beyond a renewal interval, how long a holder with no connection may take to renew (an event loop
#: late by a long torch call, a reconnect's backoff) before it is taken for gone. A renewal that
#: fails on a connection closed under it is tried again after the reconnect's backoff
#: (`SlotLease.watch`), not a renewal interval later: that wait, not this grace, once let a spare
#: take a live holder's slot on a busy machine (2026-11-29).
GRACE_S = 0.3
#: After a Redis (re)start, how long before a missing connection says anything: the clients' reconnect
#: backoff is a few seconds (services/stage_worker/membership/lease.py's PEER_GRACE_S is the same allowance).
SETTLE_S = 10.0


@dataclass(frozen=True)
class HolderSeen:
    """What a spare saw of one slot's holder, in one look."""

    connected: bool  # a connection named for the holder is open now
    renewed_ago_s: float  # since the holder last renewed its lease (its TTL minus what is left)
    redis_up_s: float  # the Redis server's uptime


@dataclass(frozen=True)
class Verdict:
    gone: bool
    why: str


def holder_gone(
    seen: HolderSeen, *, renew_every_s: float, grace_s: float = GRACE_S, settle_s: float = SETTLE_S
) -> Verdict:
    if seen.connected:
        return Verdict(False, "its connection to Redis is open")
    if seen.redis_up_s < settle_s:
        return Verdict(False, f"Redis has been up {seen.redis_up_s:.0f} s only: its clients may still be reconnecting")
    quiet_for = renew_every_s + grace_s
    if seen.renewed_ago_s <= quiet_for:
        return Verdict(False, f"it renewed {seen.renewed_ago_s:.2f} s ago: it may be reconnecting")
    return Verdict(
        True,
        f"its connections to Redis are closed and it has not renewed its lease for {seen.renewed_ago_s:.2f} s "
        f"(more than {quiet_for:.2f} s)",
    )


#: Two looks count as the same quiet spell if the holder's last renewal, as each look places it on
#: the spare's clock, moved less than this between them (the reads' own delays); a renewal moves it
#: by about a renewal interval.
SAME_RENEWAL_S = 0.25


@dataclass(frozen=True)
class Suspect:
    """A holder seen gone once: who, when (the spare's monotonic clock), and when it last renewed."""

    holder: str
    first_at: float
    renewed_at: float


class HolderWatch:
    """A spare's judgement of the holders it looks at, over its looks (pure: `now` is given).

    `judge` says gone only on the second look a renewal interval after the first, the holder gone
    in both and not renewed between; `server` and `lost_sight` restart the settle window (another
    Redis server, or the spare's own reconnect)."""

    def __init__(self, renew_every_s: float, *, grace_s: float = GRACE_S, settle_s: float = SETTLE_S) -> None:
        self.renew_every_s, self.grace_s, self.settle_s = renew_every_s, grace_s, settle_s
        self._suspects: dict[object, Suspect] = {}
        self._server: str | None = None
        self._settle_from = -math.inf
        self._blind = False

    def server(self, run_id: str, now: float) -> None:
        """The Redis server a look read (its run_id): another than the last one's (a restart or a
        failover) starts the settle window now, and what was seen before is forgotten."""
        if self._blind or (self._server is not None and run_id != self._server):
            self._settle_from, self._suspects = now, {}
        self._server, self._blind = run_id, False

    def lost_sight(self) -> None:
        """A look failed (the spare's connection broke): the next look's server starts the window again."""
        self._blind = True

    def second_look_at(self) -> float | None:
        """When the soonest second look is due (the spare's clock), if any holder was seen gone once."""
        return min((s.first_at + self.renew_every_s for s in self._suspects.values()), default=None)

    def judge(self, key: object, holder: str, seen: HolderSeen, now: float) -> Verdict:
        settled = dataclasses.replace(seen, redis_up_s=min(seen.redis_up_s, now - self._settle_from))
        verdict = holder_gone(settled, renew_every_s=self.renew_every_s, grace_s=self.grace_s, settle_s=self.settle_s)
        if not verdict.gone:
            self._suspects.pop(key, None)
            return verdict
        renewed_at = now - seen.renewed_ago_s
        first = self._suspects.get(key)
        if first is None or first.holder != holder or abs(renewed_at - first.renewed_at) > SAME_RENEWAL_S:
            self._suspects[key] = Suspect(holder, now, renewed_at)
            return Verdict(False, f"{verdict.why}; once: looked at again {self.renew_every_s:g} s later")
        if now - first.first_at < self.renew_every_s:
            return Verdict(False, f"{verdict.why}; seen so {now - first.first_at:.2f} s ago only")
        del self._suspects[key]
        return Verdict(True, f"{verdict.why}; seen so twice, {now - first.first_at:.2f} s apart")
