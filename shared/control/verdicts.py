"""Each dispatcher's verdict on whether prefill can be served (`shared.policies.readiness`), as
the run's front doors read it: a key per dispatcher with a short TTL, and the set of the run's
dispatchers that published one (`keys.serving_key`, `keys.serving_instances_key`). Under the run's
hash tag, with a dispatcher per datacenter too: a front door reads the run's verdicts in one place.

* `publish_readiness` / `withdraw_readiness`: a dispatcher's verdict written (every
  `READINESS_EVERY_S`, and at once when it changes), or taken back as it stops.
* `readiness` / `combined`: the live dispatchers' verdicts, and what a front door does with them.

Tested by: tests/integration/test_readiness.py, tests/unit/test_readiness.py.
"""

from __future__ import annotations

from typing import Any

import msgspec
from redis.asyncio import Redis

from shared.wire import keys
from shared.wire.status import ServingState

#: A dispatcher rewrites its verdict this often (and at once when it changes); front doors re-read
#: it as often, so a change reaches clients within about twice this.
READINESS_EVERY_S = 0.25


class Readiness(msgspec.Struct, frozen=True, kw_only=True):
    """One dispatcher's verdict, as stored for the front doors."""

    instance: str
    run: str
    state: ServingState
    reason: str
    retry_after_s: int
    at: float  # wall clock of the verdict
    #: the pipeline has come round once, so admission knows how fast the bubbles serve
    #: (`Admission.came_round`); until then a request with a TTFT objective is refused where no
    #: decoder can take it, and a front door stating one says so on `/ready`
    came_round: bool = True

    @property
    def ready(self) -> bool:
        return self.state.ready


async def publish_readiness(r: Redis, verdict: Readiness) -> None:
    instances = keys.serving_instances_key(verdict.run)
    async with r.pipeline(transaction=True) as pipe:
        pipe.set(keys.serving_key(verdict.run, verdict.instance), msgspec.json.encode(verdict), ex=keys.SERVING_TTL_S)
        pipe.sadd(instances, verdict.instance)
        pipe.expire(instances, keys.SERVING_INSTANCES_TTL_S)
        await pipe.execute()


async def withdraw_readiness(r: Redis, run: str, instance: str) -> None:
    """A dispatcher that stops takes its verdict with it (it would expire within the TTL anyway)."""
    async with r.pipeline(transaction=True) as pipe:
        pipe.delete(keys.serving_key(run, instance))
        pipe.srem(keys.serving_instances_key(run), instance)
        await pipe.execute()


async def readiness(r: Redis, run: str) -> list[Readiness]:
    """The verdicts of the run's live dispatchers; a member whose verdict expired (its dispatcher
    died without withdrawing it) is dropped from the set. Unreadable records are skipped."""
    members: Any = await r.smembers(keys.serving_instances_key(run))
    instances = sorted(m.decode() for m in members)
    raws: Any = await r.mget([keys.serving_key(run, i) for i in instances]) if instances else []
    out = []
    for instance, raw in zip(instances, raws, strict=True):
        if raw is None:
            await r.srem(keys.serving_instances_key(run), instance)
            continue
        try:
            out.append(msgspec.json.decode(raw, type=Readiness))
        except msgspec.DecodeError:
            continue
    return out


def combined(verdicts: list[Readiness]) -> Readiness | None:
    """What a front door does with the verdicts: serve if any dispatcher serves; else the newest
    refusal. None when no dispatcher is alive (requests are accepted and wait for one)."""
    if not verdicts:
        return None
    serving = [v for v in verdicts if v.ready]
    return max(serving or verdicts, key=lambda v: v.at)
