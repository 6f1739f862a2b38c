"""Slot leases: any worker process can take any free (replica, stage) slot.

A lease is a Redis key holding the worker's id with a TTL, renewed every second. Two workers
never hold one slot (SET NX); a crashed worker's slot frees within the TTL, so a replacement can
take it, and its peers notice the loss and stop with an error naming the slot instead of hanging.
A worker that finishes its training leaves a `done` marker, so its departure is not a failure.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

from redis.asyncio import Redis

from shared import keys
from shared.logs import get_logger

log = get_logger(__name__)

# Compare-and-renew / compare-and-delete: only the holder may touch its lease.
_RENEW = "if redis.call('get', KEYS[1]) == ARGV[1] then return redis.call('pexpire', KEYS[1], ARGV[2]) end return 0"
_RELEASE = "if redis.call('get', KEYS[1]) == ARGV[1] then return redis.call('del', KEYS[1]) end return 0"

#: A finished worker's marker outlives any run's tail (peers still finishing their last steps).
DONE_TTL_S = 3600


class SlotError(RuntimeError):
    """No free slot, a lost lease, or a peer that disappeared; the message names the slot."""


class RunStopped(SlotError):
    """A peer was stopped on purpose (an operator's Ctrl-C or SIGTERM): the run ends, not failed."""


#: The abort reason of a deliberate stop starts with this.
STOPPED_PREFIX = "stopped: "


@dataclass(frozen=True)
class Slot:
    replica: int
    stage: int

    @property
    def name(self) -> str:
        return f"r{self.replica}s{self.stage}"


class SlotLease:
    def __init__(self, r: Redis, run: str, pp: int, dp: int, holder: str) -> None:
        self.r, self.run, self.pp, self.dp, self.holder = r, run, pp, dp, holder
        self.slot: Slot | None = None
        self.all_slots = [Slot(d, k) for k in range(pp) for d in range(dp)]
        #: Set after the start barrier: from then on a missing peer is a failure.
        self.check_peers = False

    def _key(self, s: Slot) -> str:
        return keys.lease_key(self.run, s.replica, s.stage)

    def _done_key(self, s: Slot) -> str:
        return self._key(s) + ":done"

    def _aborted_key(self, s: Slot) -> str:
        return self._key(s) + ":aborted"

    async def acquire(self) -> Slot:
        for s in self.all_slots:
            if await self.r.set(self._key(s), self.holder, nx=True, px=keys.LEASE_TTL_MS):
                self.slot = s
                log.info("slot leased", run=self.run, slot=s.name, holder=self.holder)
                return s
        raise SlotError(
            f"all {len(self.all_slots)} slots of run {self.run!r} (PP={self.pp} x DP={self.dp}) are "
            "held by live workers; start fewer workers or raise the parallelism in the spec"
        )

    async def renew(self) -> None:
        assert self.slot is not None
        ok = await self.r.eval(_RENEW, 1, self._key(self.slot), self.holder, keys.LEASE_TTL_MS)
        if not ok:
            raise SlotError(f"lost the lease of slot {self.slot.name} (expired or taken over)")

    async def wait_for_all(self, timeout_s: float) -> None:
        """Start barrier: return once every slot is held (`watch` keeps renewing ours meanwhile)."""
        deadline = time.monotonic() + timeout_s
        while True:
            missing = await self._missing()
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
        until cancelled; raises `SlotError` on a loss."""
        while True:
            await asyncio.sleep(keys.LEASE_RENEW_S)
            await self.renew()
            if self.check_peers:
                for s in await self._missing():
                    # A peer that stopped because of another failure left that failure's reason.
                    why = await self.r.get(self._aborted_key(s))
                    if isinstance(why, bytes):
                        reason = why.decode()
                        if reason.startswith(STOPPED_PREFIX):
                            raise RunStopped(reason)
                        raise SlotError(reason)
                    raise SlotError(f"slot {s.name} lost its worker (its lease expired): the run cannot continue")

    async def _missing(self) -> list[Slot]:
        held = await self.r.mget([self._key(s) for s in self.all_slots])
        done = await self.r.mget([self._done_key(s) for s in self.all_slots])
        return [s for s, h, d in zip(self.all_slots, held, done, strict=True) if h is None and d is None]

    async def finish(self) -> None:
        """Mark our slot done (so peers don't count our exit as a failure), then release it."""
        if self.slot is not None:
            await self.r.set(self._done_key(self.slot), self.holder, ex=DONE_TTL_S)
            await self.release()

    async def abort(self, reason: str) -> None:
        """We stop because of `reason` (another slot's failure): leave it for the peers, so they
        report the original culprit rather than our own departure."""
        if self.slot is not None:
            await self.r.set(self._aborted_key(self.slot), reason, ex=DONE_TTL_S)

    async def mark_stopped(self, reason: str) -> None:
        """We were told to stop (SIGTERM, Ctrl-C): peers that notice our departure stop quietly
        with this reason instead of reporting a lost worker."""
        if self.slot is not None:
            await self.r.set(self._aborted_key(self.slot), f"{STOPPED_PREFIX}{reason}", ex=DONE_TTL_S)

    async def release(self) -> None:
        if self.slot is not None:
            await self.r.eval(_RELEASE, 1, self._key(self.slot), self.holder)
