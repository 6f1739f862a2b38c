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

A dead host closes nothing (no FIN reaches Redis): its workers' slots free at the TTL, as before.
Pure: the caller reads Redis and passes what it saw.
"""

from __future__ import annotations

from dataclasses import dataclass

#: Beyond a renewal interval, how long a holder with no connection may take to renew (an event loop
#: late by a long torch call, a reconnect's backoff) before it is taken for gone. A renewal that
#: fails on a connection closed under it is tried again after the reconnect's backoff
#: (`SlotLease.watch`), not a renewal interval later: that wait, not this grace, once let a spare
#: take a live holder's slot on a busy machine (2026-11-29).
GRACE_S = 0.3
#: After a Redis (re)start, how long before a missing connection says anything: the clients' reconnect
#: backoff is a few seconds (services/stage_worker/lease.py's PEER_GRACE_S is the same allowance).
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
