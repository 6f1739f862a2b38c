"""What a dispatcher finds as it takes over a run: the work its predecessors left.

* **Their pending entries** (`claim`): every entry of the dispatcher group pending on any other
  consumer (a request each held until answered, what they read and had not acked) moves to this
  term's consumer at once, not after `bus.claim_idle_ms`: every stream it reads is the run's own
  (the request stream too: `keys.prefill_requests_stream`), so the group's other consumers are the
  run's earlier dispatchers, and the lease says they are gone or fenced. Each consumer's first read
  (its own pending entries) then delivers them, a request as delivered again (so it is looked up
  first: one answered meanwhile is only acked).
* **What they read later** (`sweep`): a deposed leader let go on after a stall can read entries
  before its fence stops it, after this term claimed; they would sit pending on it until
  `bus.claim_idle_ms` (a report unread, its batch then taken for lost and its requests sent again).
  The leader moves any entry pending on another consumer to itself every `SWEEP_EVERY_S` and
  re-reads its own pending entries.
* **What they measured** (`measurement`): the leader publishes its bubbles' rate and the
  correction of its predictions (`publish_measurement`, every `verdicts.READINESS_EVERY_S`, kept
  `keys.DISPATCHER_MEASURED_TTL_S`); a new leader in another process starts from it
  (`DispatchState.carry_admission`) until its own first round is measured. Measuring afresh, it
  refused every new request with an objective (a 429) for about an iteration after each takeover.
* **Their batches on the workers** (`held_batches`): a worker acks a fill stream's entry only once
  its batch is answered and reported, so the entries its group has not acked (pending, or not read
  yet) are the batches it holds. The term adopts them (`DispatchState.adopt`): their requests,
  delivered to it again, are not sent a second time, and their reports are its own.

Tested by: tests/integration/test_dispatcher_leadership.py, tests/unit/test_dispatch_takeover.py.
"""

from __future__ import annotations

import time
from typing import Any

import msgspec
from redis.asyncio import Redis
from redis.exceptions import ResponseError

from shared.bus.connection import TRANSIENT_ERRORS, ride_out
from shared.bus.consumer import Consumer
from shared.bus.streams import claim_all, claim_strays, parse_id
from shared.config.model_info import ModelInfo
from shared.policies.dc_routing import DcSnapshot
from shared.policies.dispatch import DispatchState
from shared.policies.dispatch_inputs import Adopted
from shared.runtime.logs import get_logger
from shared.wire import FIELD, PrefillBatch, WireError, decode, keys

log = get_logger(__name__)

#: How often a leader looks for entries pending on another consumer of its group (one XPENDING a
#: stream when there are none): a deposed leader's late reads wait at most this, not claim_idle_ms.
SWEEP_EVERY_S = 1.0


async def claim(c: Consumer) -> int:
    """Move every entry pending in `c`'s group on its stream to `c` (riding a Redis outage out)."""
    return await ride_out(lambda: claim_all(c.bus.redis, c.stream, c.group, c.name), f"claim of {c.stream}")


async def sweep(consumers: list[Consumer]) -> int:
    """Move to each of `consumers` (this term's) the entries pending in its group on another
    consumer, and have it re-read its own pending entries if any moved. Returns how many moved."""
    total = 0
    for c in consumers:
        moved = await claim_strays(c.bus.redis, c.stream, c.group, c.name)
        if moved:
            c.resync()
            total += sum(moved.values())
            log.warning(
                "took over entries another dispatcher read after this one leads (a deposed leader let go on)",
                stream=c.stream,
                moved=moved,
            )
    return total


async def publish_measurement(r: Redis, run: str, state: DispatchState[Any], dc: str | None = None) -> None:
    """The leader's measurement of the bubbles, for a leader after it (once it is measured)."""
    now = time.time()
    if state.came_round(now):
        snap = msgspec.json.encode(state.snapshot(dc or "", True, now))
        await r.set(keys.dispatcher_measured_key(run, dc), snap, ex=keys.DISPATCHER_MEASURED_TTL_S)


async def publish_snapshot(r: Redis, run: str, state: DispatchState[Any], dc: str, ready: bool) -> None:
    """A datacenter's dispatcher's snapshot for the front doors, with its verdict `ready`
    (`keys.dc_snapshot_key`; every `dc_routing.publish_every_s`)."""
    board = msgspec.json.encode(state.snapshot(dc, ready, time.time()))
    await r.set(keys.dc_snapshot_key(run, dc), board, ex=keys.DC_SNAPSHOT_TTL_S)


async def measurement(r: Redis, run: str, dc: str | None = None) -> DcSnapshot | None:
    """What the run's (or `dc`'s) last leader measured of the bubbles (None: none within the TTL,
    unreadable, or Redis away: this term measures afresh)."""
    try:
        raw: Any = await r.get(keys.dispatcher_measured_key(run, dc))
    except TRANSIENT_ERRORS as exc:
        log.warning("the last leader's measurement not read", run=run, error=repr(exc))
        return None
    try:
        return msgspec.json.decode(raw, type=DcSnapshot) if raw is not None else None
    except msgspec.DecodeError as exc:  # (a ValidationError too)
        log.warning("the last leader's measurement unreadable", run=run, error=repr(exc))
        return None


async def held_batches(
    r: Redis, run: str, stages: list[int], dp: int, dc: str | None = None
) -> list[tuple[str, PrefillBatch]]:
    """Every batch the workers of `stages` hold (datacenter `dc`'s dispatcher's: `pipeline_plan.stages_of`),
    with its fill stream: the entries the workers' group has not acked (riding a Redis outage out)."""
    streams = [keys.fill_stream(run, d, k, dc) for d in range(dp) for k in stages]

    async def read() -> list[tuple[str, PrefillBatch]]:
        return [(s, b) for s in streams for b in await _held(r, s)]

    return await ride_out(read, "the batches the workers hold")


async def _held(r: Redis, stream: str) -> list[PrefillBatch]:
    try:
        groups: Any = await r.xinfo_groups(stream)
    except ResponseError:  # no such stream: nothing was ever sent there
        return []
    group = next((g for g in groups if _text(g["name"]) == keys.FILL_GROUP), None)
    last = parse_id(_text(group["last-delivered-id"])) if group is not None else (0, -1)  # none read
    pending: set[str] = set()
    if group is not None and group["pending"]:
        rows: Any = await r.xpending_range(stream, keys.FILL_GROUP, min="-", max="+", count=int(group["pending"]))
        pending = {_text(row["message_id"]) for row in rows}
    held = []
    entries: Any = await r.xrange(stream)  # only unacked work is kept long (`trim_acked`)
    for entry_id, fields in entries:
        eid = _text(entry_id)
        if eid not in pending and parse_id(eid) <= last:
            continue  # acked: used, reported
        try:
            m = decode(fields.get(FIELD))
        except WireError:
            continue  # the worker dead-letters it: nothing held
        if isinstance(m, PrefillBatch):
            held.append(m)
    return held


def adopted(stream: str, b: PrefillBatch, model: ModelInfo) -> Adopted:
    """`b`, held on the worker whose fill stream is `stream`, as the dispatch policy adopts it."""
    items = tuple((it.id, it.from_layer, it.predicted_ms / 1000) for it in b.items)
    return Adopted(b.batch_id, b.worker, stream, items, sum(model.kv_bytes(len(it.tokens)) for it in b.items))


def _text(v: Any) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)
