"""The run's dispatcher lease as a dispatcher holds it: the shell around `shared.policies.leadership`.

One task (`watch`) takes a step whenever the policy says: the script its role picks (a standby's
take, a leader's compare-and-renew), each returning the lease as it left it; the policy's
`Decision` is logged when the role or the leader changes, with its why, and sets the events the
process's terms wait on (`leading`, `deposed`; services/dispatcher/serve.py).

What the leader writes to the workers is fenced by the same key (`fence`, checked by the scripts
of services/dispatcher/writes.py in the same atomic step as the writes); a write refused there,
or not tried because the lease lapsed here (`leads`), ends the term at once (`refused`).

Tested by: tests/unit/test_leadership.py, tests/integration/test_dispatcher_leadership.py.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from redis.asyncio import Redis

from shared.bus.connection import TRANSIENT_ERRORS, Outage
from shared.control.leases import release_dispatcher_if_held_by
from shared.policies.leadership import Decision, Leadership, Move, Seen
from shared.runtime.logs import get_logger
from shared.wire import keys
from shared.wire.status import DispatcherRole

log = get_logger(__name__)

# Each script returns the lease as it left it: {holder ('' for nobody), its TTL left in ms}.
# A standby's take: the key if nobody holds it, or if it is its own (a take whose reply was lost).
_TAKE = """
local v = redis.call('GET', KEYS[1])
if not v or v == ARGV[1] then
  redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
  return {ARGV[1], tonumber(ARGV[2])}
end
return {v, redis.call('PTTL', KEYS[1])}
"""
# A leader's compare-and-renew: only its holder renews it; a lease gone is not taken back here
# (the policy steps down: a new term starts from nothing).
_RENEW = """
local v = redis.call('GET', KEYS[1])
if v == ARGV[1] then
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
  return {v, tonumber(ARGV[2])}
end
if not v then return {'', 0} end
return {v, redis.call('PTTL', KEYS[1])}
"""


class DispatcherLease:
    """`me`'s hold on the run's dispatcher lease: standby until it takes it, then leader until
    it steps down (and standby again)."""

    def __init__(
        self,
        r: Redis,
        run: str,
        me: str,
        *,
        ttl_ms: int = keys.DISPATCHER_LEASE_TTL_MS,
        renew_every_s: float = keys.DISPATCHER_LEASE_RENEW_S,
        dc: str | None = None,
    ) -> None:
        self.r, self.run, self.me, self.ttl_ms = r, run, me, ttl_ms
        self.dc = dc  # the datacenter it would lead (None: the run)
        self.key = keys.dispatcher_lease_key(run, dc)
        self.policy = Leadership(me, ttl_s=ttl_ms / 1000, renew_every_s=renew_every_s)
        self.leading = asyncio.Event()  # set while this dispatcher leads
        self.deposed = asyncio.Event()  # set when it stops leading, until it leads again
        #: how many times it began to lead: a term that began at another count was deposed since,
        #: though `deposed` may be clear again (it led again before the term looked)
        self.terms = 0
        self.leader: str | None = None  # who leads, as the last step saw
        self.why = ""  # the last change's why
        self._wake = asyncio.Event()  # step now (a fenced write was refused)

    def leads_term(self, term: int) -> bool:
        """Whether it leads still in the term that began at `term` (`terms` then): not deposed
        since, though it may have led again meanwhile."""
        return not self.deposed.is_set() and self.terms == term

    @property
    def role(self) -> DispatcherRole:
        return self.policy.role

    def leads(self) -> bool:
        """Whether this dispatcher may write as the leader now (checked before each write)."""
        return self.policy.leads(time.monotonic())

    def fence(self) -> tuple[str, str]:
        """(the lease's key, the value it must hold) for a write fenced by it."""
        return self.key, self.me

    async def step(self) -> Seen:
        """The step the role picks; the lease as it left it."""
        script = _RENEW if self.policy.role is DispatcherRole.LEADER else _TAKE
        sent = time.monotonic()
        reply: Any = await self.r.eval(script, 1, self.key, self.me, self.ttl_ms)
        holder = reply[0].decode() if isinstance(reply[0], bytes) else str(reply[0])
        return Seen(holder or None, max(int(reply[1]), 0) / 1000, sent)

    async def watch(self, stop: asyncio.Event) -> None:
        """Step until `stop`: standby, leader, standby again as the policy decides."""
        outage = Outage(f"dispatcher lease of run {self.run}")
        while not stop.is_set():
            backoff = 0.0
            try:
                decision = await self.step_once()
                outage.ok()
            except TRANSIENT_ERRORS as exc:
                backoff = outage.failed(exc)
                decision = self._act(self.policy.decide(None, time.monotonic()))
            self._wake.clear()
            await _first(stop, self._wake, max(decision.look_in_s, min(backoff, 1.0)))

    async def step_once(self) -> Decision:
        """One step and what the policy makes of it, acted on (logged, the events set)."""
        seen = await self.step()
        return self._act(self.policy.decide(seen, time.monotonic()))

    def refused(self, why: str) -> None:
        """A write the lease fences was refused, or not tried: stop leading now."""
        if self.policy.role is DispatcherRole.LEADER:
            self._act(self.policy.step_down(why))
            self._wake.set()

    async def release(self) -> None:
        """A stopping dispatcher hands the lease over (if it holds it): a standby takes it at its
        next step rather than at the lease's end. Redis away: it ends by itself."""
        if self.policy.role is not DispatcherRole.LEADER:
            return
        self._act(self.policy.step_down("stopping"))
        try:
            await release_dispatcher_if_held_by(self.r, self.run, self.me, self.dc)
        except TRANSIENT_ERRORS as exc:
            log.warning("dispatcher lease not released; it ends by itself", run=self.run, error=repr(exc))

    def _act(self, d: Decision) -> Decision:
        match d.move:
            case Move.LEAD:
                log.info("dispatcher leads the run", run=self.run, dispatcher=self.me, why=d.why)
                self.terms += 1
                self.deposed.clear()
                self.leading.set()
            case Move.STEP_DOWN:
                level = log.info if d.why == "stopping" else log.warning
                level("dispatcher steps down: it stops dispatching", run=self.run, dispatcher=self.me, why=d.why)
                self.leading.clear()
                self.deposed.set()
            case Move.STAND_BY if d.leader is not None and d.leader != self.leader:
                log.info("standby: another dispatcher leads the run", run=self.run, leader=d.leader, why=d.why)
            case _:
                pass
        if d.move is not Move.STAND_BY or d.leader is not None:
            self.leader = d.leader
        self.why = d.why
        return d


async def _first(stop: asyncio.Event, wake: asyncio.Event, seconds: float) -> None:
    """Sleep `seconds`, or less if `stop` or `wake` is set meanwhile."""
    if seconds <= 0:
        return
    if stop.is_set() or wake.is_set():
        return
    waits = [asyncio.ensure_future(stop.wait()), asyncio.ensure_future(wake.wait())]
    try:
        await asyncio.wait(waits, timeout=seconds, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for w in waits:
            w.cancel()
        await asyncio.gather(*waits, return_exceptions=True)
