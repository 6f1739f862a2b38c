"""The serving plane's records in Redis, written atomically (Lua), shared by every service.

Each call names its run and, with a dispatcher per datacenter (`bubbletea.dispatch: per_dc`), the
datacenter `dc` the request was routed to: the request stream and the in-flight count are that
dispatcher's (`keys.prefill_requests_stream`, `keys.prefill_inflight_key`), so two runs on one
Redis neither read each other's requests nor count them against each other's limit; so is a
request's record (one hash: its status, then its answer, `keys.prefill_request_key`) and the results
stream its answer goes to. Every script and MULTI here touches the keys of one hash tag alone
(`keys.dispatch_tag`: the run's, or its datacenter's): one slot of a Redis Cluster. The one step
that spans two, a client's Idempotency-Key with a dispatcher per datacenter, is two steps that
each hold alone (`claim_idempotency`, then `accept`).

* `accept`: admission control and enqueue in one step: count the request in flight (refusing it
  beyond the limit: `prefill.max_queue_depth` bounds each dispatcher's queue), mark it queued,
  append it to the request stream. A 2xx is only answered
  after this succeeded, and on a cluster after a replica acknowledged it (`replicated`), so an
  accepted request is always on the bus, a master's failover included.
* `answer`: the first answer to a request wins (exactly-once in effect): store it, clear its
  queued mark, count it out of flight and notify the accepting front door, all or nothing.
  A duplicate answer (a redelivered batch) changes nothing. The dispatcher's answers are fenced
  by its lease (`queue_answer`'s `fence`): a deposed dispatcher's are refused.
* `fail_dead_request`: a request the dispatcher dead-letters is answered, failed, through `answer`
  (so it is counted out of flight), not left to its client's timeout.
* `reconcile_inflight`: the in-flight count lowered to what the request stream holds unacked, so
  that no lost decrement makes it creep toward the limit (and permanent 429s).
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import msgspec
from redis.asyncio import Redis
from redis.asyncio.client import Pipeline

from shared.bus.replicated import replicated
from shared.runtime.logs import get_logger
from shared.wire import FIELD, PrefillRequest, PrefillResult, WireError, decode, encode, keys
from shared.wire.status import FailureReason, RequestStatus

log = get_logger(__name__)

# With a client's key (ARGV[6], the request id): one dispatcher for the run looks the key up here
# (KEYS[4]) and records it with the enqueue; a datacenter's (no KEYS[4]: the key was claimed in the
# run's tag first, `claim_idempotency`) enqueues the claimed id unless its record exists already.
_ACCEPT = """
if ARGV[6] ~= '' then
  if #KEYS == 4 then
    local existing = redis.call('GET', KEYS[4])
    if existing then return existing end
  elseif redis.call('EXISTS', KEYS[2]) == 1 then
    return ARGV[6]
  end
end
local n = redis.call('INCR', KEYS[1])
if n > tonumber(ARGV[1]) then
  redis.call('DECR', KEYS[1])
  return 0
end
redis.call('HSET', KEYS[2], ARGV[7], ARGV[5])
redis.call('EXPIRE', KEYS[2], ARGV[3])
redis.call('XADD', KEYS[3], '*', ARGV[4], ARGV[2])
if ARGV[6] ~= '' and #KEYS == 4 then redis.call('SET', KEYS[4], ARGV[6], 'EX', ARGV[3]) end
return n
"""

# A client's key, claimed for a request of one datacenter (ARGV[1]: JSON [dc, id]) unless it was
# claimed before: then the claim it has (its request, perhaps in another datacenter).
_CLAIM = """
local existing = redis.call('GET', KEYS[1])
if existing then return existing end
redis.call('SET', KEYS[1], ARGV[1], 'EX', ARGV[2])
return false
"""

# The first answer wins: HSETNX of the record's result field; only that one clears the queued
# status, restarts the record's TTL from the answer, counts the request out of flight and notifies.
# With a fence (KEYS[4], ARGV[8]: a dispatcher lease and its holder), nothing is written unless the
# lease holds that value: a deposed dispatcher's answer is refused (-1).
_ANSWER = """
if KEYS[4] and redis.call('GET', KEYS[4]) ~= ARGV[8] then return -1 end
if redis.call('HSETNX', KEYS[1], ARGV[6], ARGV[1]) == 1 then
  redis.call('HDEL', KEYS[1], ARGV[7])
  redis.call('EXPIRE', KEYS[1], ARGV[2])
  if tonumber(redis.call('GET', KEYS[2]) or '0') > 0 then redis.call('DECR', KEYS[2]) end
  redis.call('XADD', KEYS[3], 'MAXLEN', '~', ARGV[4], '*', ARGV[3], ARGV[1])
  redis.call('EXPIRE', KEYS[3], ARGV[5])
  return 1
end
return 0
"""

#: How often a dispatcher checks the in-flight count against the request stream (`reconcile_inflight`):
#: a drift is corrected within this, and the XINFO it costs is one per dispatcher this often.
INFLIGHT_RECONCILE_S = 10.0

# In flight is at most the request stream's (KEYS[2]) entries its group has not acked (pending) or
# not read (lag): a request is acked once answered or failed, and a dead letter with its record. It
# can be fewer (an answered request's entry is acked a moment later; a dead dispatcher's, once
# reclaimed), so the count is only ever lowered to that bound, never raised to it.
_RECONCILE = """
if redis.call('EXISTS', KEYS[2]) == 0 then return -1 end
local bound = nil
for _, g in ipairs(redis.call('XINFO', 'GROUPS', KEYS[2])) do
  local f = {}
  for i = 1, #g, 2 do f[g[i]] = g[i + 1] end
  if f['name'] == ARGV[1] then
    if type(f['lag']) ~= 'number' then return -1 end
    bound = f['pending'] + f['lag']
  end
end
if bound == nil then return -1 end
local n = tonumber(redis.call('GET', KEYS[1]) or '0')
if n > bound then
  redis.call('SET', KEYS[1], bound)
  return bound
end
return n
"""

#: Each front door's results stream keeps its last answers (it reads them within milliseconds),
#: and goes an hour after the last one (its front door is gone): see `keys.PREFILL_RESULTS_MAXLEN`.
RESULTS_MAXLEN = keys.PREFILL_RESULTS_MAXLEN


def accept_args(
    run: str, req: PrefillRequest, max_inflight: int, idempotency_key: str | None = None, dc: str | None = None
) -> tuple[Any, ...]:
    """`accept`'s script and its keys and arguments (for a pipeline that accepts many at once)."""
    idem = (keys.idempotency_key(run, idempotency_key or ""),) if dc is None else ()
    return (
        _ACCEPT,
        3 + len(idem),
        keys.prefill_inflight_key(run, dc),
        keys.prefill_request_key(run, req.id, dc),
        keys.prefill_requests_stream(run, dc),
        *idem,
        max_inflight,
        encode(req),
        keys.PREFILL_RECORD_TTL_S,
        FIELD,
        RequestStatus.QUEUED.value,
        req.id if idempotency_key is not None else "",
        keys.PREFILL_STATUS_FIELD,
    )


async def accept(
    r: Redis,
    run: str,
    req: PrefillRequest,
    max_inflight: int,
    *,
    idempotency_key: str | None = None,
    dc: str | None = None,
) -> bool | str:
    """Enqueue `req` on `run`'s request stream (or datacenter `dc`'s, where a dispatcher serves each)
    unless `max_inflight` of its requests are already waiting; False = refused (429).

    With a client's `idempotency_key`: if it was used before, nothing is enqueued and the id of the
    request it created is returned (a str). With one dispatcher the key is recorded in the same
    script as the enqueue, so a front door killed (or Redis lost) in between can never leave a key
    naming a request that was never queued. With a dispatcher per datacenter the key was claimed
    first (`claim_idempotency`: `req` carries the claimed id, in the claimed datacenter) and the
    enqueue is of that id unless its record exists: a claim whose front door died before it
    enqueued is enqueued by the client's retry."""
    args = accept_args(run, req, max_inflight, idempotency_key, dc)
    # On a cluster, a replica holds the acceptance before the front door answers 2xx: a failover
    # right after cannot lose an accepted request (shared/bus/replicated.py).
    (n,) = await replicated(r, keys.prefill_requests_stream(run, dc), lambda pipe: pipe.eval(*args), "accept")
    if isinstance(n, bytes):
        return n.decode()
    return int(n) > 0


async def claim_idempotency(r: Redis, run: str, key: str, dc: str, request_id: str) -> tuple[str, str] | None:
    """With a dispatcher per datacenter: claim the client's `key` for `request_id`, to be accepted in
    `dc`; None when it is now this request's, else (datacenter, id) of the request it was claimed for
    before (accept that one, `accept`, and answer with its id). The claim lives in the run's tag (a
    client's key is the run's, whichever datacenter takes the request), with the records' hour. On a
    cluster a replica holds the claim before the request is accepted (`replicated`): a failover of
    the run's master in between cannot take the claim back while the request it names stands, and
    the client's retry then claim (and enqueue) a second request."""
    idem = keys.idempotency_key(run, key)
    args = (_CLAIM, 1, idem, json.dumps([dc, request_id]), keys.PREFILL_RECORD_TTL_S)
    (got,) = await replicated(r, idem, lambda pipe: pipe.eval(*args), "idempotency claim")
    if got is None:
        return None
    try:
        found = json.loads(got)
    except ValueError:  # not JSON: a plain id, written with one dispatcher for the run (`accept`)
        found = None
    if not (isinstance(found, list) and len(found) == 2 and all(isinstance(x, str) for x in found)):
        raise WireError(f"idempotency key {key!r} of run {run} holds {got!r}, not a claim [dc, id]")
    return found[0], found[1]


def _answer_args(
    run: str, result: PrefillResult, reply_to: str, fence: tuple[str, str] | None = None, dc: str | None = None
) -> tuple[Any, ...]:
    fenced = () if fence is None else (fence[0],)
    return (
        _ANSWER,
        3 + len(fenced),
        keys.prefill_request_key(run, result.id, dc),
        keys.prefill_inflight_key(run, dc),
        reply_to,
        *fenced,
        encode(result),
        keys.PREFILL_RECORD_TTL_S,
        FIELD,
        RESULTS_MAXLEN,
        keys.PREFILL_RESULTS_TTL_S,
        keys.PREFILL_RESULT_FIELD,
        keys.PREFILL_STATUS_FIELD,
        *(() if fence is None else (fence[1],)),
    )


async def answer(r: Redis, run: str, result: PrefillResult, reply_to: str, dc: str | None = None) -> bool:
    """Record the answer to a request of `run` (of its datacenter `dc`, where it was routed to one;
    first answer wins), count it out of flight and notify its front door."""
    ok: Any = await r.eval(*_answer_args(run, result, reply_to, None, dc))
    return bool(ok)


def queue_answer(
    pipe: Pipeline,
    run: str,
    result: PrefillResult,
    reply_to: str,
    fence: tuple[str, str] | None = None,
    dc: str | None = None,
) -> None:
    """`answer`, queued on a pipeline: many answers (and what follows them) in one round trip.
    With a `fence` (a key and the value it must hold: the dispatcher's lease), it is written only
    while the key holds it."""
    pipe.eval(*_answer_args(run, result, reply_to, fence, dc))


def request_of(raw: bytes | None) -> tuple[str, str] | None:
    """(id, reply_to) of a request entry's payload, decoded as ours or, if it is not (another wire
    version, a field that no longer checks), read as a plain msgpack map; None if neither has them."""
    try:
        req = decode(raw or b"")
    except WireError:
        try:
            fields = msgspec.msgpack.decode(raw or b"")
        except msgspec.DecodeError:
            return None
        if not isinstance(fields, dict):
            return None
        rid, reply_to = fields.get("id"), fields.get("reply_to")
        return (rid, reply_to) if isinstance(rid, str) and isinstance(reply_to, str) and rid and reply_to else None
    return (req.id, req.reply_to) if isinstance(req, PrefillRequest) else None


async def fail_dead_request(r: Redis, run: str, raw: bytes | None, error: str, dc: str | None = None) -> None:
    """The last word on an entry of `run`'s request stream (datacenter `dc`'s) the dispatcher
    dead-letters: the request, if it names one, is failed (`FailureReason.DEAD_LETTERED`) through
    `answer`, so its client hears why at once and it is counted out of flight. One already answered
    stays answered (the first answer wins)."""
    found = request_of(raw)
    if found is None:
        return
    rid, reply_to = found
    if not keys.under_dispatch_tag(reply_to, run, dc):
        # no front door of the run reads there (on a cluster: another slot, which the answer script
        # cannot touch); the request stays queued in its record until its TTL, as nobody waits on it
        log.warning("dead request names a results stream outside its run: not answered", id=rid, reply_to=reply_to)
        return
    failed = PrefillResult(
        id=rid,
        status=RequestStatus.FAILED,
        reason=FailureReason.DEAD_LETTERED,
        error=f"the dispatcher could not handle this request: {error}"[:500],
        finished=time.time(),
    )
    await answer(r, run, failed, reply_to, dc)


async def reconcile_inflight(r: Redis, run: str, group: str, dc: str | None = None) -> int | None:
    """Lower `run`'s in-flight count (datacenter `dc`'s) to its request stream's unacked entries of
    `group` (pending + not read) if it is above them (a lost decrement), atomically with the scripts
    that move it; the count now, or None when the bound cannot be known (no such group yet, or the
    stream trimmed under it)."""
    n: Any = await r.eval(
        _RECONCILE, 2, keys.prefill_inflight_key(run, dc), keys.prefill_requests_stream(run, dc), group
    )
    return None if int(n) < 0 else int(n)


async def read_by_client(r: Redis, run: str, request_ids: list[str], dc: str | None = None) -> None:
    """`run`'s answers to `request_ids` (routed to `dc`) were read by their clients: each record now
    goes within `keys.PREFILL_READ_GRACE_S`. One round trip for all; the records share one tag, so
    one node takes it on a cluster. A plain EXPIRE (not ``LT``, which Redis 6.2, the embedded server's, lacks):
    a record within the grace of its hour's end is given the grace again, at most 2 minutes more."""
    if not request_ids:
        return
    async with r.pipeline(transaction=False) as pipe:
        for rid in request_ids:
            pipe.expire(keys.prefill_request_key(run, rid, dc), keys.PREFILL_READ_GRACE_S)
        await pipe.execute()


@dataclass(frozen=True)
class Lookup:
    """What Redis knows of a request: its status, and its answer once it has one."""

    status: RequestStatus
    result: PrefillResult | None = None


async def lookup(r: Redis, run: str, request_id: str, dc: str | None = None) -> Lookup | None:
    """The status of `run`'s request (routed to `dc`; with its answer when answered), or None
    (unknown or expired).

    Both fields of its record in one HMGET: read one after the other, an answer landing in between
    (status deleted, result written) would make a live request look unknown."""
    found: Any = await r.hmget(
        keys.prefill_request_key(run, request_id, dc), [keys.PREFILL_RESULT_FIELD, keys.PREFILL_STATUS_FIELD]
    )
    return _looked_up(request_id, found)


async def find(r: Redis, run: str, request_id: str, dcs: Sequence[str | None]) -> tuple[str | None, Lookup] | None:
    """Which of `dcs` (the run's dispatchers) holds `run`'s request, and its status there (`lookup`);
    None where none does. One round trip: an HMGET per datacenter (a client's GET names the request,
    not where it was routed; a cluster's pipeline sends each to its node)."""
    async with r.pipeline(transaction=False) as pipe:
        for dc in dcs:
            pipe.hmget(
                keys.prefill_request_key(run, request_id, dc), [keys.PREFILL_RESULT_FIELD, keys.PREFILL_STATUS_FIELD]
            )
        found: Any = await pipe.execute()
    for dc, fields in zip(dcs, found, strict=True):
        looked = _looked_up(request_id, fields)
        if looked is not None:
            return dc, looked
    return None


def _looked_up(request_id: str, fields: Any) -> Lookup | None:
    raw, status = fields
    if raw is not None:
        msg = decode(raw)
        if not isinstance(msg, PrefillResult):
            raise WireError(f"the record of request {request_id} holds a {type(msg).__name__}, not a PrefillResult")
        return Lookup(msg.status, msg)
    return Lookup(RequestStatus(status.decode())) if status is not None else None


async def inflight(r: Redis, run: str, dcs: Sequence[str | None] = (None,)) -> int:
    """`run`'s requests accepted and not yet answered, summed over its dispatchers `dcs` (each
    one's count is what `prefill.max_queue_depth` bounds)."""
    total = 0
    for dc in dcs:  # one GET each: on a cluster, each datacenter's count is on its own node
        n: Any = await r.get(keys.prefill_inflight_key(run, dc))
        total += int(n) if n is not None else 0
    return total
