"""Slot leases: any worker process can take any free (replica, stage) slot.

A lease is a Redis key holding the worker's id with a TTL, renewed every second. Two workers
never hold one slot (SET NX); a crashed worker's slot frees within the TTL, so a replacement can
take it, and its peers notice the loss and stop with an error naming the slot instead of hanging.
A worker that leaves on purpose writes its slot's end marker first (`LeaseState`: done, stopped,
or aborted because of another slot, with the reason), so its departure is read for what it was.

A Redis outage is not a lost lease. While Redis does not answer, `watch` backs off and retries
(logging once); on reconnect it renews, and if our key expired meanwhile (the outage outlasted the
TTL) it takes the slot back with SET NX: nobody could take it while Redis was down. A slot held
by another worker on reconnect is lost (SlotError); so is every slot if Redis restarted without
an append-only file (a new replication id; a failover's promoted replica continues ours). For
`PEER_GRACE_S` after a reconnect the peers' leases are not checked, so they can re-take theirs.

Tests: tests/integration/test_slot_lease.py, test_lease_liveness.py, test_redis_restart.py, test_failover.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass

from redis.asyncio import Redis

from shared.bus.connection import TRANSIENT_ERRORS, Outage
from shared.control.leases import (
    ClientListRefused,
    look_at_holders,
    release_if_held_by,
    server_info,
    slot_end,
    slot_name,
)
from shared.policies.lease_liveness import HolderWatch
from shared.runtime.logs import get_logger
from shared.wire import keys
from shared.wire.status import LeaseState

log = get_logger(__name__)

# Compare-and-renew; after an outage, take back if free or ours (our other renewal took it first).
_RENEW = "if redis.call('get', KEYS[1]) == ARGV[1] then return redis.call('pexpire', KEYS[1], ARGV[2]) end return 0"
_RETAKE = "return (redis.call('get',KEYS[1]) or ARGV[1])==ARGV[1] and redis.call('set',KEYS[1],ARGV[1],'px',ARGV[2])"
#: A slot's end marker, written only by its lease's holder.
_END = """
if redis.call('GET', KEYS[1]) ~= ARGV[1] then return 0 end
redis.call('HSET', KEYS[2], 'state', ARGV[2], 'reason', ARGV[3], 'holder', ARGV[1])
redis.call('EXPIRE', KEYS[2], ARGV[4])
return 1
"""


#: After a Redis outage, how long peers' missing leases are tolerated: each peer re-takes its own
#: as it reconnects (its client's retry, its backoff and one renew interval: a few seconds).
PEER_GRACE_S = 10.0
#: How often a spare looks for a free slot: a lost worker's slot frees when its lease expires
#: (LEASE_TTL_MS), so this adds little to a takeover.
SPARE_POLL_S = 0.5
#: A holder whose last renewal was sent longer ago than this renews before it handles a message
#: (`SlotLease.fence`): two renewal intervals, a second inside the lease's TTL.
FENCE_AFTER_S = 2 * keys.LEASE_RENEW_S


class SlotError(RuntimeError):
    """No free slot, a lost lease, or a peer that disappeared; the message names the slot."""


class RunStopped(SlotError):
    """A peer was stopped on purpose (an operator's Ctrl-C or SIGTERM): the run ends, not failed."""


@dataclass(frozen=True)
class Slot:
    replica: int
    stage: int

    @property
    def name(self) -> str:
        return slot_name(self.replica, self.stage)


class SlotLease:
    def __init__(
        self, r: Redis, run: str, pp: int, dp: int, holder: str, *, recoverable: bool = False, liveness: bool = False
    ) -> None:
        self.r, self.run, self.pp, self.dp, self.holder = r, run, pp, dp, holder
        #: Take a held slot whose holder is gone (its connections closed: `lease_liveness`) before
        #: its lease expires. Only where every holder's connections carry its name (the workers').
        self.liveness = liveness
        #: the spare's judgement over its looks (two a renewal apart; `lease_liveness.HolderWatch`)
        self.holders = HolderWatch(keys.LEASE_RENEW_S)
        self.slot: Slot | None = None
        self.all_slots = [Slot(d, k) for k in range(pp) for d in range(dp)]
        #: Set while training: from then on a missing peer is a failure (or, if the run
        #: `recoverable`, a loss to recover from: `peer_lost` is set instead of raising).
        self.check_peers = False
        self.recoverable = recoverable
        self.peer_lost = asyncio.Event()
        #: Peer checks `watch` completed (a passing one leaves no other trace; a test waits for one).
        self.peer_checks = 0
        #: The Redis server's replication id when we leased, or after the last outage (`_check_not_wiped`).
        self.redis_replid = ""
        #: Set when this worker is asked to leave the run (`bubbletea drain`, seen at a renewal).
        self.drain = asyncio.Event()
        #: When the last successful renewal was sent (monotonic): `watch` and `confirm` keep it.
        self.renewed_at = time.monotonic()

    def _key(self, s: Slot) -> str:
        return keys.lease_key(self.run, s.replica, s.stage)

    def _end_key(self, s: Slot) -> str:
        return keys.lease_end_key(self.run, s.replica, s.stage)

    async def acquire(self, wait_s: float = 0.0, allowed: Callable[[Slot], bool] | None = None) -> Slot:
        """Lease the first free slot (among those `allowed`: the slots of this host's datacenter,
        `BUBBLETEA_DC`). If every one is held, look again for `wait_s` (a replacement started as
        its dead predecessor's lease has yet to expire), then fail."""
        deadline = time.monotonic() + wait_s
        candidates = [s for s in self.all_slots if allowed is None or allowed(s)]
        while True:
            for s in candidates:
                if await self.r.set(self._key(s), self.holder, nx=True, px=keys.LEASE_TTL_MS):
                    await self._took(s)
                    log.info("slot leased", run=self.run, slot=s.name, holder=self.holder)
                    return s
            if time.monotonic() >= deadline:
                break
            if await self._free_gone(candidates):
                continue  # a dead predecessor's slot, freed before its lease expired: take it now
            await asyncio.sleep(0.1)  # leases expire by TTL: there is no event to wait on
        which = (
            ""
            if len(candidates) == len(self.all_slots)
            else f" ({len(candidates)} of them in this worker's datacenter)"
        )
        raise SlotError(
            f"all {len(self.all_slots)} slots of run {self.run!r} (PP={self.pp} x DP={self.dp}){which} are "
            "held by live workers; start fewer workers or raise the parallelism in the spec"
        )

    async def wait_as_spare(
        self, stop: asyncio.Event, allowed: Callable[[Slot], bool] | None = None, poll_s: float = SPARE_POLL_S
    ) -> Slot | None:
        """Every slot is held: wait, as a spare, for the first one to free (its worker died and its
        lease expired, or it was stopped) and lease it; None if `stop` is set first, or once every
        slot it may take finished training (a slot whose worker ended `done` is not taken over:
        nothing is left to train there). Only a run that recovers has use for a spare: the peers
        resume with it from the newest checkpoint."""
        candidates = [s for s in self.all_slots if allowed is None or allowed(s)]
        log.info(
            "every slot is held: waiting as a spare to take over the first that frees",
            run=self.run,
            slots=len(candidates),
            holder=self.holder,
        )
        done: set[Slot] = set()  # slots that finished training: never taken over, not asked again
        while not stop.is_set():
            for s in candidates:
                if s in done or not await self.r.set(self._key(s), self.holder, nx=True, px=keys.LEASE_TTL_MS):
                    continue
                # A finishing worker writes its end before it releases: leased, its end is visible.
                if (await self.ended(s))[0] is LeaseState.DONE:
                    await release_if_held_by(self.r, self.run, s.replica, s.stage, self.holder)
                    done.add(s)
                    continue
                await self._took(s)
                log.info("slot leased by a spare", run=self.run, slot=s.name, holder=self.holder)
                return s
            if len(done) == len(candidates):
                log.info("every slot this spare could take finished training: nothing to take over", run=self.run)
                return None
            if await self._free_gone([s for s in candidates if s not in done]):
                continue  # a dead holder's slot, freed before its lease expired: take it now
            # a holder seen gone once is looked at again exactly a renewal interval later, not at
            # the next poll: the wait the second look asks for, and no more
            second = self.holders.second_look_at()
            wait = poll_s if second is None else min(poll_s, max(0.0, second - time.monotonic()))
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), wait)
        return None

    async def _free_gone(self, slots: list[Slot]) -> bool:
        """With `liveness`: release the leases of `slots` whose holder is gone (its process died:
        `shared.policies.lease_liveness`), saying why; True if any was. A Redis that refuses CLIENT
        LIST turns the check off (the lease's expiry still frees the slot)."""
        if not self.liveness:
            return False
        try:
            look = await look_at_holders(self.r, self.run, [(s.replica, s.stage) for s in slots], self.holder)
        except ClientListRefused as exc:
            return self._liveness_off("Redis refused CLIENT LIST", str(exc))
        except TRANSIENT_ERRORS:
            self.holders.lost_sight()  # its clients reconnect too: the settle window starts again
            raise
        if not look.sees_itself:  # a proxy or a cluster: nobody's connections would show
            return self._liveness_off("Redis's CLIENT LIST does not show this worker's own connection", "")
        now = time.monotonic()
        self.holders.server(look.run_id, now)
        freed = False
        for (d, k), (holder, what) in look.holders.items():
            verdict = self.holders.judge((d, k), holder, what, now)
            if verdict.gone and await release_if_held_by(self.r, self.run, d, k, holder):
                log.warning(
                    "a slot's holder is gone: its lease released before it expired",
                    run=self.run,
                    slot=slot_name(d, k),
                    gone=holder,
                    why=verdict.why,
                )
                freed = True
        return freed

    def _liveness_off(self, what: str, error: str) -> bool:
        log.warning(f"{what}: a dead worker's slot frees only when its lease expires", run=self.run, error=error)
        self.liveness = False
        return False

    async def _took(self, s: Slot) -> None:
        """Slot `s` is ours: its predecessor's end marker (it left, say) and drain request go."""
        self.slot = s
        self.redis_replid = (await self._replids())[0]
        await self.r.delete(self._end_key(s), keys.drain_key(self.run, s.name))

    async def renew(self, *, last_ok: float | None = None) -> None:
        """Renew our lease. If the last successful renewal (`last_ok`, monotonic) is older than the
        TTL, Redis was unreachable in between and the key may have expired: it is taken back if free,
        unless Redis restarted without an append-only file (the run fails saying so). Raises
        SlotError if the key expired otherwise or another worker holds it."""
        assert self.slot is not None
        key = self._key(self.slot)
        ok = await self.r.eval(_RENEW, 1, key, self.holder, keys.LEASE_TTL_MS)
        if ok:
            return
        late = last_ok is not None and time.monotonic() - last_ok > keys.LEASE_TTL_MS / 1000
        if late:
            await self._check_not_wiped()
            if await self.r.eval(_RETAKE, 1, key, self.holder, keys.LEASE_TTL_MS):
                log.warning("lease expired during the Redis outage; taken back", run=self.run, slot=self.slot.name)
                return
        raise SlotError(f"lost the lease of slot {self.slot.name} (expired or taken over)")

    async def fence(self) -> None:
        """Awaited before this worker handles what its slot's streams deliver (`Consumer` fence):
        free while the last renewal was sent under `FENCE_AFTER_S` ago (the key cannot have expired,
        let alone been taken); past that (the worker was stalled, or cut off from Redis) it renews
        first (`confirm`), raising SlotError if the slot is another's. A stale worker read its
        replacement's inbox as the same consumer when a partition healed and its handlers took the
        messages for good: the pipeline hung until a recovery (issue 62, `bench/faults.py`)."""
        if time.monotonic() - self.renewed_at >= FENCE_AFTER_S:
            await self.confirm()

    async def confirm(self) -> None:
        """Renew now, before this worker acts for its slot where a stale holder would do harm
        (joining a generation: `joining.py:join`). SlotError if the lease is another's: a worker
        cut off from Redis (a partition, no FIN) whose slot a spare took learns of the move of the
        generation and of its lost lease together when the network heals, and `watch` may be in its
        backoff; without this it joined the new generation beside its replacement (issue 62,
        `bench/faults.py` lost-host)."""
        sent = time.monotonic()
        await self.renew(last_ok=self.renewed_at)
        self.renewed_at = sent

    async def _replids(self) -> tuple[str, str]:
        """The replication ids of our lease's server (its own; the one a promoted replica continues)."""
        assert self.slot is not None
        info = await server_info(self.r, "replication", self._key(self.slot))
        return str(info.get("master_replid", "")), str(info.get("master_replid2", ""))

    async def _check_not_wiped(self) -> None:
        """SlotError if Redis restarted since we leased without AOF (a new replication history)."""
        assert self.slot is not None
        if self.redis_replid not in (ids := await self._replids()):  # neither the same server nor a failover
            persistence = await server_info(self.r, "persistence", self._key(self.slot))
            if not int(persistence.get("aof_enabled", 0)):
                raise SlotError(
                    f"Redis restarted without persistence (no append-only file) while slot {self.slot.name} "
                    "was training: the run's messages in flight are lost, so the run cannot continue"
                )
        self.redis_replid = ids[0]

    async def wait_for_all(self, timeout_s: float) -> None:
        """Start barrier: return once every slot is held (`watch` keeps renewing ours meanwhile)."""
        deadline = time.monotonic() + timeout_s
        outage = Outage(f"start barrier of run {self.run}")
        while True:
            try:
                missing = await self._missing()
            except TRANSIENT_ERRORS as exc:  # Redis away: keep waiting (the deadline still holds)
                missing = self.all_slots
                await asyncio.sleep(outage.failed(exc))
            else:
                outage.ok()
            if not missing:
                self.check_peers = True
                return
            if time.monotonic() > deadline:
                raise SlotError(
                    f"timed out after {timeout_s:.0f}s waiting for workers of slots "
                    f"{', '.join(s.name for s in missing)}"
                )
            await asyncio.sleep(0.05)  # start-up poll: leases are keys, there is no event to wait on

    async def watch(self) -> None:
        """From acquisition on: renew our lease and (after the start barrier) check the peers',
        until cancelled; raises `SlotError` on a loss. A Redis outage is ridden out (see the
        module's docstring), however long: the peers' inputs stop coming meanwhile anyway."""
        assert self.slot is not None
        outage = Outage(f"lease of slot {self.slot.name}")
        peers_from = 0.0  # monotonic time from which the peers' leases are checked
        self.renewed_at = time.monotonic()
        wait = keys.LEASE_RENEW_S
        while True:
            await asyncio.sleep(wait)
            wait = keys.LEASE_RENEW_S
            try:
                sent = time.monotonic()
                await self.renew(last_ok=self.renewed_at)
                if not self.drain.is_set() and await self.r.exists(keys.drain_key(self.run, self.slot.name)):
                    log.info("asked to leave the run (bubbletea drain)", run=self.run, slot=self.slot.name)
                    self.drain.set()
                late = time.monotonic() - self.renewed_at > keys.LEASE_TTL_MS / 1000
                self.renewed_at = sent
                if outage.ok() or late:
                    peers_from = time.monotonic() + PEER_GRACE_S
                    self.redis_replid = (await self._replids())[0]  # what the next outage compares
                if self.check_peers and time.monotonic() >= peers_from:
                    await self._check_peers()
                    self.peer_checks += 1
            except TRANSIENT_ERRORS as exc:
                # again after the backoff, not a renewal interval later: a live worker whose
                # connections were closed under it renews at once on a new one, before a spare
                # takes it for gone (`lease_liveness`; a CI run saw that happen)
                wait = outage.failed(exc)

    async def _check_peers(self) -> None:
        for s in await self._missing():
            state, reason = await self.ended(s)
            if state is LeaseState.STOPPED:
                raise RunStopped(reason)
            if state is LeaseState.ABORTED:  # it left because of another slot: blame that one
                raise SlotError(reason)
            if self.recoverable:
                why = "left the run (drained)" if state is LeaseState.LEFT else "lost its worker"
                log.warning(f"a peer {why}; the run pauses for a replacement", run=self.run, slot=s.name)
                self.check_peers = False  # until the run has recovered
                self.peer_lost.set()
                return
            raise SlotError(f"slot {s.name} lost its worker (its lease expired): the run cannot continue")

    async def _missing(self) -> list[Slot]:
        """Slots with neither a live lease nor a `done` end (a finished worker is not missing)."""
        held = await self.r.mget([self._key(s) for s in self.all_slots])
        out = []
        for s, h in zip(self.all_slots, held, strict=True):
            if h is None and (await self.ended(s))[0] is not LeaseState.DONE:
                out.append(s)
        return out

    async def ended(self, s: Slot) -> tuple[LeaseState | None, str]:
        """How slot `s` ended (None: it has not, or its worker vanished without a word)."""
        return await slot_end(self.r, self.run, s.replica, s.stage)

    async def _end(self, state: LeaseState, reason: str) -> None:
        """Say how our slot ended, if it is still ours: a worker whose slot another took (it was
        cut off, or stalled) says nothing, or its peers would read its end as the new holder's
        (an ABORTED marker made every peer fail, naming the stale worker's loss: issue 62)."""
        if self.slot is not None:
            await self.r.eval(
                _END, 2, self._key(self.slot), self._end_key(self.slot),
                self.holder, state.value, reason, keys.LEASE_END_TTL_S,
            )  # fmt: skip

    async def finish(self) -> None:
        """Mark our slot done (so peers don't count our exit as a failure), then release it."""
        await self._end(LeaseState.DONE, f"slot {self.slot.name if self.slot else '?'} finished training")
        await self.release()

    async def abort(self, reason: str) -> None:
        """We stop because of `reason` (another slot's failure): leave it for the peers, so they
        report the original culprit rather than our own departure."""
        await self._end(LeaseState.ABORTED, reason)

    async def mark_stopped(self, reason: str) -> None:
        """We were told to stop (SIGTERM, Ctrl-C): peers that notice our departure stop quietly
        with this reason instead of reporting a lost worker."""
        await self._end(LeaseState.STOPPED, reason)

    async def leave(self, reason: str) -> None:
        """We leave on purpose while the run goes on (a drain): peers recover at once, and a spare
        or a replacement takes the slot."""
        await self._end(LeaseState.LEFT, reason)
        await self.release()

    async def release(self) -> None:
        if self.slot is not None:
            await release_if_held_by(self.r, self.run, self.slot.replica, self.slot.stage, self.holder)
