"""A run's recovery generations in Redis (the worker's side of shared/policies/recovery.py; the
checkpoints themselves are the stage port's, `port_state.py`).

Workers train together only within one *generation*. Every worker joins one when it starts and
again when it notices a lost peer (or that the generation moved on without it):

1. **enter**: a starting worker moves the generation on (INCR); a worker that noticed a loss moves
   it on from the one it trained in (compare-and-set, so peers noticing the same loss together move
   it once), or adopts a newer one someone else already began. It drops everything it held of the
   old generation *before* it says it joined, so any tensor of the new one it receives is kept.
2. **barrier**: it adds its slot to the generation's joined set and waits until every slot is there
   (so every lease is held by a live worker again). If the generation moves on meanwhile (another
   replacement arrived), it enters the newer one, and so it does if the move comes while it forms
   the generation's data-plane groups (`take_part.py`: the peers went on to the newer one, and the
   old groups would never form). Two replacements arriving together cost one extra round, never a
   split: a worker only ever joins the current generation.
3. **resume point**: each worker says, as it joins, which iteration it last stepped (the state it
   holds); the first worker through plans the resume from those and the checkpoints
   (`shared.policies.recovery.plan_resume`: the live peers' state where every stage has a worker
   holding the newest, else the newest checkpoint common to every slot) and writes the plan
   (SET NX); every worker reads that one plan, so they all resume at the same iteration.

Tensors carry the generation they were sent in; a receiver drops another generation's (sent before
the run resumed; the broker may still deliver them). No stage can finish an iteration of the new
generation before every stage has restored (its gradient depends on all of them), so no checkpoint
is written between the barrier and the last restore.

Tests: tests/integration/test_recovery_generations.py, tests/e2e/test_recovery_formation.py.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Iterable
from typing import Any

from redis.asyncio import Redis

from services.stage_worker.membership.lease import Slot, SlotError
from shared.bus.connection import TRANSIENT_ERRORS, Outage, blocking_client
from shared.policies.membership_moves import Membership
from shared.policies.recovery import FROM_SCRATCH, Resume, Source, plan_resume
from shared.runtime.logs import get_logger
from shared.wire import keys

log = get_logger(__name__)

#: Moves the generation on from ARGV[1] (the one the caller trained in) unless it already moved;
#: returns the current one either way.
_MOVE_ON = """
local g = tonumber(redis.call('get', KEYS[1]) or '0')
if g == tonumber(ARGV[1]) then g = redis.call('incr', KEYS[1]) end
redis.call('expire', KEYS[1], ARGV[2])
return g
"""
#: How often the barrier looks at the joined set and the generation (a few round trips a second).
POLL_S = 0.05
#: Without an announcement, how often a training worker looks whether the generation moved on.
LOOK_S = keys.LEASE_RENEW_S
#: The moves announced (`keys.generation_moves_stream`) that Redis keeps: only the newest wake anyone.
MOVES_KEPT = 64


class Generations:
    def __init__(
        self,
        r: Redis,
        run: str,
        slots: Iterable[Slot],
        *,
        url: str | None = None,
        name: str = "",
        member: Membership | None = None,
    ) -> None:
        self.r, self.run = r, run
        #: Where `moved` opens its blocking reader of the announced moves (None: it only looks).
        self.url, self.name = url, name
        self.all = list(slots)
        self.slots = [s.name for s in self.all]
        #: This worker's membership: the generation it trains in, what it last stepped.
        self.member = member if member is not None else Membership()
        #: Runs each time this worker enters a newer generation, before it says it joined: the one
        #: reset of its runtime state (`take_part.py` sets it).
        self.on_enter: Callable[[int], None] | None = None

    @property
    def current(self) -> int:
        """The generation this worker trains in (0: not joined yet)."""
        return self.member.generation

    @property
    def stepped(self) -> int:
        """The iteration this worker last stepped (what it says as it joins; -1: none)."""
        return self.member.stepped

    def _enter_newer(self, gen: int) -> None:
        """The one place this worker moves to a newer generation: its own or a replacement's."""
        self.member.entered(gen)
        if self.on_enter is not None:
            self.on_enter(gen)

    async def read(self) -> int:
        return int(await self.r.get(keys.generation_key(self.run)) or 0)

    async def enter(self, *, after_loss: bool) -> int:
        """Join a new generation: INCR for a starting worker; after a loss, move on from the one we
        trained in (or adopt a newer one). Enters it (`on_enter`) before anything else can see us join."""
        gen_key = keys.generation_key(self.run)
        if after_loss:
            gen = int(await self.r.eval(_MOVE_ON, 1, gen_key, self.current, keys.RUN_STATE_TTL_S))
        else:
            async with self.r.pipeline(transaction=True) as pipe:
                pipe.incr(gen_key)
                pipe.expire(gen_key, keys.RUN_STATE_TTL_S)
                gen = int((await pipe.execute())[0])
        self._enter_newer(gen)
        await self._announce(gen)
        return gen

    async def _announce(self, gen: int) -> None:
        """Wake the workers still training in an older generation (`moved`); every worker entering
        says so, once the counter moved (a duplicate wakes a reader that finds nothing new)."""
        stream = keys.generation_moves_stream(self.run)
        async with self.r.pipeline(transaction=False) as pipe:
            pipe.xadd(stream, {"gen": gen}, maxlen=MOVES_KEPT, approximate=True)
            pipe.expire(stream, keys.RUN_STATE_TTL_S)
            await pipe.execute()

    async def moved(self) -> None:
        """Return once the run's generation moved past ours (a replacement joined, or a peer noticed
        a loss: the run resumes without us until we join). Woken by the moves announced on the
        run's stream; looks at the counter every `LOOK_S` regardless (a move announced before the
        reader began, Redis away), so a missed announcement costs a look, never the move."""
        stream = keys.generation_moves_stream(self.run)
        wake = blocking_client(self.url, name=self.name or "bubbletea-reader") if self.url else None
        outage = Outage(f"generation watch of run {self.run}")
        last: Any = "$"
        try:
            while True:
                try:
                    if wake is None:
                        await asyncio.sleep(LOOK_S)
                    else:
                        reply: Any = await wake.xread({stream: last}, block=int(LOOK_S * 1000), count=MOVES_KEPT)
                        last = reply[0][1][-1][0] if reply else last
                    newest = await self.read()
                except TRANSIENT_ERRORS as exc:
                    await asyncio.sleep(outage.failed(exc))
                    continue
                outage.ok()
                if newest > self.current:
                    return
        finally:
            if wake is not None:
                await wake.aclose()

    async def barrier(self, slot: Slot, timeout_s: float) -> int:
        """Wait until every slot joined the current generation (entering newer ones as they come,
        `on_enter`); returns it. Raises SlotError naming the slots still missing after `timeout_s`."""
        deadline = time.monotonic() + timeout_s
        outage = Outage(f"recovery barrier of run {self.run}")
        joined_gen = 0
        missing: list[str] = list(self.slots)
        while True:
            try:
                if joined_gen != self.current:
                    await self._join(self.current, slot)
                    joined_gen = self.current
                joined, newest = await self._look(self.current)
                outage.ok()
                if newest > self.current:  # a replacement began a newer generation: follow it
                    self._enter_newer(newest)
                    continue
                missing = [s for s in self.slots if s not in joined]
                if not missing:
                    return self.current
            except TRANSIENT_ERRORS as exc:  # Redis away: keep waiting (the deadline still holds)
                await asyncio.sleep(outage.failed(exc))
                continue
            if time.monotonic() > deadline:
                raise SlotError(
                    f"timed out after {timeout_s:.0f}s waiting for workers of slots {', '.join(missing)} "
                    f"to join the run (generation {self.current})"
                )
            await asyncio.sleep(POLL_S)  # joins are set members: there is no event to wait on

    async def _join(self, gen: int, slot: Slot) -> None:
        key, stepped = keys.generation_joined_key(self.run, gen), keys.generation_stepped_key(self.run, gen)
        async with self.r.pipeline(transaction=True) as pipe:
            pipe.hset(stepped, slot.name, self.stepped)  # before the join: whoever sees it joined sees this
            pipe.expire(stepped, keys.RUN_STATE_TTL_S)
            pipe.sadd(key, slot.name)
            pipe.expire(key, keys.RUN_STATE_TTL_S)
            await pipe.execute()

    async def _look(self, gen: int) -> tuple[set[str], int]:
        async with self.r.pipeline(transaction=False) as pipe:
            pipe.smembers(keys.generation_joined_key(self.run, gen))
            pipe.get(keys.generation_key(self.run))
            members, newest = await pipe.execute()
        return {m.decode() for m in members}, int(newest or 0)

    async def resume_point(self, iterations: Callable[[], Awaitable[dict[str, list[int]]]] | None) -> Resume:
        """Where the current generation resumes, the same for every worker. `iterations()`: which
        iterations every slot has a checkpoint of (the stage port's; None: no checkpoints)."""
        key = keys.generation_resume_key(self.run, self.current)
        found = await self.r.get(key)
        if found is None:
            raw = await self.r.hgetall(keys.generation_stepped_key(self.run, self.current))
            said = {_text(k): int(v) for k, v in raw.items()}
            stepped = {(s.replica, s.stage): said.get(s.name, FROM_SCRATCH) for s in self.all}
            names = {(s.replica, s.stage): s.name for s in self.all}
            checkpoints = await iterations() if iterations is not None else {}
            plan = plan_resume(stepped, checkpoints, names)
            await self.r.set(key, plan.encode(), nx=True, ex=keys.RUN_STATE_TTL_S)
            found = await self.r.get(key)
        if found is None:  # expired between the two calls (a day's TTL): nothing to resume from
            return Resume(FROM_SCRATCH, Source.SCRATCH)
        return Resume.decode(_text(found))


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value
