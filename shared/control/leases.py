"""The run's slot leases as anyone may read them (the dispatcher's readiness gate, the workers);
and a dead holder's lease (a worker's, the dispatcher's) released by its supervisor.

A worker holds its (replica, stage) slot with a TTL key and, when it leaves on purpose, writes the
slot's end marker (a hash: `LeaseState` and reason); see services/stage_worker/membership/lease.py, which
writes them. Reading needs no worker code, so it lives here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from redis.asyncio import Redis
from redis.exceptions import ResponseError

from shared.bus.connection import Client, is_cluster, node_of
from shared.policies.lease_liveness import HolderSeen
from shared.policies.readiness import SlotView
from shared.wire import keys
from shared.wire.status import LeaseState


def slot_name(replica: int, stage: int) -> str:
    return f"r{replica}s{stage}"


def holder_client_name(holder: str) -> str:
    """The name every Redis connection of the stage worker `holder` carries (CLIENT SETNAME), so a
    spare can tell from CLIENT LIST that a slot's holder has none left (`look_at_holders`)."""
    return f"stage_worker:{holder}"


class ClientListRefused(RuntimeError):
    """Redis refused CLIENT LIST (an ACL without it), or cannot answer it for every lease (a
    cluster with the leases on several nodes): only the lease's expiry tells a dead holder."""


def _lease_node_target(r: Client, lease_keys: list[str]) -> dict[str, Any]:
    """Where a look's CLIENT LIST and INFO go: on a Redis Cluster, the one node holding the lease
    keys (a holder renewing its lease keeps a connection to that node, named for it); nothing to
    add on a plain Redis. Leases on several nodes cannot be judged from one: ClientListRefused,
    which turns the check off (once, with this reason) and leaves the leases' expiry."""
    if not is_cluster(r) or not lease_keys:
        return {}
    nodes = {node.name: node for node in (node_of(r, k) for k in lease_keys) if node is not None}
    if len(nodes) != 1:
        raise ClientListRefused(
            f"the run's leases are on {len(nodes)} Redis Cluster nodes (keys without one hash tag): "
            "CLIENT LIST of one node cannot tell their holders' connections"
        )
    return {"target_nodes": next(iter(nodes.values()))}


async def server_info(r: Client, section: str, key: str) -> dict[str, Any]:
    """INFO `section` of the server holding `key` (on a Redis Cluster, its slot's master: a
    failover changes its run_id, as a restart does)."""
    info: Any = await r.info(section, **_lease_node_target(r, [key]))
    return dict(info)


@dataclass(frozen=True)
class Look:
    """One look of a spare's at the holders: each held slot's (holder, what was seen), the Redis
    server's run_id, and whether the spare's own connection (named `me`) shows in CLIENT LIST."""

    holders: dict[tuple[int, int], tuple[str, HolderSeen]]
    run_id: str
    sees_itself: bool


async def look_at_holders(r: Redis, run: str, slots: list[tuple[int, int]], me: str = "") -> Look:
    """What a spare sees of each held slot's holder (`shared.policies.lease_liveness`): whether a
    connection named for it is open, how long ago it renewed, and Redis's uptime (on a Redis
    Cluster: of the node holding the leases, `_lease_node_target`). Slots not held are
    left out. The leases are read first: a holder then seen with no connection open had not renewed
    for at least that long (a live one that reconnects meanwhile is seen connected)."""
    async with r.pipeline(transaction=False) as pipe:
        for d, k in slots:
            pipe.get(keys.lease_key(run, d, k))
            pipe.pttl(keys.lease_key(run, d, k))
        found: Any = await pipe.execute()
    target = _lease_node_target(r, [keys.lease_key(run, d, k) for d, k in slots])
    try:
        clients: Any = await r.client_list(_type="normal", **target)
    except ResponseError as exc:
        raise ClientListRefused(str(exc)) from exc
    info: Any = await r.info("server", **target)
    up_s = float(info.get("uptime_in_seconds", 0))
    names = {c.get("name", "") for c in clients}
    sees_itself = not me or holder_client_name(me) in names
    out = {}
    for (d, k), holder, pttl in zip(slots, found[::2], found[1::2], strict=True):
        if holder is None or pttl < 0:  # free, or (never here) a lease without a TTL
            continue
        who = holder.decode()
        renewed_ago_s = (keys.LEASE_TTL_MS - pttl) / 1000
        out[(d, k)] = (who, HolderSeen(holder_client_name(who) in names, renewed_ago_s, up_s))
    return Look(out, str(info.get("run_id", "")), sees_itself)


async def slot_end(r: Redis, run: str, replica: int, stage: int) -> tuple[LeaseState | None, str]:
    """How the slot ended (None: it has not, or its worker vanished without a word), and why."""
    found: Any = await r.hmget(keys.lease_end_key(run, replica, stage), ["state", "reason"])
    state, reason = found
    if state is None:
        return None, ""
    return LeaseState(state.decode()), (reason or b"").decode()


async def read_slots(r: Redis, run: str, pp: int, dp: int) -> list[SlotView]:
    """Every slot of the run: held or not, and its end marker, in two round trips."""
    slots = [(d, k) for k in range(pp) for d in range(dp)]
    held: Any = await r.mget([keys.lease_key(run, d, k) for d, k in slots])
    async with r.pipeline(transaction=False) as pipe:
        for d, k in slots:
            pipe.hmget(keys.lease_end_key(run, d, k), ["state", "reason"])
        ends: Any = await pipe.execute()
    out = []
    for (d, k), h, (state, reason) in zip(slots, held, ends, strict=True):
        ended = LeaseState(state.decode()) if state is not None else None
        out.append(SlotView(slot_name(d, k), h is not None, ended, (reason or b"").decode()))
    return out


async def generation_joined(r: Redis, run: str, slots: int) -> bool:
    """Whether every slot joined the run's current recovery generation: its workers are past their
    set-up (model built, checkpoint restored) and train together (services/stage_worker/membership/generations.py)."""
    gen: Any = await r.get(keys.generation_key(run))
    if gen is None:
        return False
    joined: Any = await r.scard(keys.generation_joined_key(run, int(gen)))
    return int(joined) >= slots


#: Deletes the lease KEYS[1] only if its holder is ARGV[1].
_RELEASE_IF = "if redis.call('get', KEYS[1]) == ARGV[1] then return redis.call('del', KEYS[1]) end return 0"


async def release_dead(r: Redis, run: str, pp: int, dp: int, holder: str) -> list[str]:
    """Release every slot lease of `run` held by `holder`, a worker known dead (its supervisor saw
    its process exit): its peers notice the loss at their next check, and a replacement takes the
    slot at once, instead of both waiting for the lease to expire. Returns the slots released."""
    released = []
    for d in range(dp):
        for k in range(pp):
            if await release_if_held_by(r, run, d, k, holder):
                released.append(slot_name(d, k))
    return released


async def release_if_held_by(r: Redis, run: str, replica: int, stage: int, holder: str) -> bool:
    """Delete the slot's lease if `holder` still holds it (a worker known dead, or one handing its
    slot over as it stops); True if it did. The one compare-and-delete every lease release uses."""
    return bool(await r.eval(_RELEASE_IF, 1, keys.lease_key(run, replica, stage), holder))


async def release_dispatcher_if_held_by(r: Redis, run: str, holder: str, dc: str | None = None) -> bool:
    """Delete the run's (or datacenter `dc`'s) dispatcher lease if `holder` still holds it (a
    dispatcher known dead: its supervisor saw its process exit; or one stepping down as it stops),
    so its successor leads at once rather than at the lease's end; True if it did."""
    return bool(await r.eval(_RELEASE_IF, 1, keys.dispatcher_lease_key(run, dc), holder))
