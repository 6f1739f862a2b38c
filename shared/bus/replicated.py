"""Writes a replica has acknowledged (``WAIT``) before anyone is told they happened.

A Redis Cluster replicates asynchronously: a master answers a write, then streams it to its
replica. A master SIGKILLed loses what it had answered and not yet streamed; its promoted replica
holds a prefix of the master's replication stream. One run's keys share one hash tag (one slot,
one master), so that prefix is a consistent earlier state of the whole run. What a failover can
break is a promise made outside Redis on a write the prefix lacks: a 2xx for a request that is no
longer queued, or a report of answers that are gone. `replicated` makes the promise wait for the
replica: it runs the caller's commands and then ``WAIT 1 <timeout>`` on the same connection (WAIT
counts that connection's own writes), in one round trip, and only then returns.

Routing on a cluster: redis-py's `ClusterPipeline` sends a keyless WAIT to every primary unless
told otherwise, so it is sent with ``target_nodes=`` the node of the commands' key: the pipeline
puts every command for one node on one connection, in order. If a command was redirected (MOVED:
the slot moved in a failover, and the pipeline resent it alone to its new master, on another
connection) the WAIT answered for the wrong node (an error from a replica, or a count for writes
not its own); the commands' results are kept and a second round trip, a one-key write in the same
slot then WAIT, covers them: any write on the slot's master after theirs is after them in its
replication stream.

A plain Redis (no ``redis+cluster://``) has no failover here: nothing is waited for, and no round
trip is added. A master with no replica connected (its replica died, or is still syncing) cannot
acknowledge within `ACK_TIMEOUT_MS`: the write stands (nothing a replica could have saved is lost
by going on; a second fault before it is back would lose it) and a warning is logged, at most once
per `WARN_EVERY_S`.

Tested by: tests/integration/test_failover.py.
"""

from __future__ import annotations

import inspect
import time
from collections.abc import Awaitable, Callable
from typing import Any

from redis.asyncio import Redis
from redis.asyncio.client import Pipeline

from shared.bus.connection import is_cluster, node_of
from shared.runtime.logs import get_logger
from shared.wire import keys

log = get_logger(__name__)

#: Replicas that must acknowledge: each master of the embedded cluster (and of a usual managed one)
#: has one; the write is then on two machines, and one failover cannot lose it.
REPLICAS = 1
#: How long a write waits for its replica's acknowledgement. A live replica acknowledges within a
#: round trip (milliseconds: the master asks for its offset at once); this only bounds what a
#: master whose replica is gone costs each write (then the write goes on, unacknowledged, logged).
ACK_TIMEOUT_MS = 1000
#: The "not acknowledged" warning is logged at most this often (with how many since).
WARN_EVERY_S = 30.0

_warned = {"at": -WARN_EVERY_S, "since": 0}


async def replicated(
    r: Redis,
    key: str,
    queue: Callable[[Pipeline], Awaitable[None] | None],
    what: str,
    *,
    then: Callable[[Pipeline], None] | None = None,
) -> list[Any]:
    """Run the commands `queue` puts on a pipeline (non-transactional; all in `key`'s slot; `queue`
    may be a coroutine function), then, on a cluster, wait for `REPLICAS` replica of `key`'s master
    to hold them; then the commands `then` puts on a pipeline (what must follow them only once they
    are safe: a report naming them). Returns the replies of `queue`'s commands (the first error
    raised, as ``execute()`` does). `what`: named in the warning. On a plain Redis, both go in one
    round trip, as before there was a cluster."""
    if not is_cluster(r):
        async with r.pipeline(transaction=False) as pipe:
            await _queued(queue, pipe)
            n = len(pipe)
            if then is not None:
                then(pipe)
            return list(await pipe.execute())[:n]
    await r.initialize()  # RedisCluster: the slot map (once; then at once)
    node = node_of(r, key)
    async with r.pipeline(transaction=False) as pipe:
        await _queued(queue, pipe)
        out = await _acknowledged(r, key, node, pipe, what)
    if then is not None:
        async with r.pipeline(transaction=False) as pipe:
            then(pipe)
            await pipe.execute()
    return out


async def _acknowledged(r: Redis, key: str, node: Any, pipe: Pipeline, what: str) -> list[Any]:
    """`pipe`'s commands and WAIT on one connection to `node` (`key`'s master); their replies."""
    pipe.execute_command("WAIT", REPLICAS, ACK_TIMEOUT_MS, target_nodes=node)
    *out, acked = list(await pipe.execute(raise_on_error=False))
    for reply in out:
        if isinstance(reply, Exception):
            raise reply
    if not isinstance(acked, int) or node_of(r, key) != node:  # redirected: WAIT was another connection's
        acked = await _wait_after_write(r, key)
    if acked < REPLICAS:
        _not_acknowledged(what, acked)
    return out


async def _queued(queue: Callable[[Pipeline], Awaitable[None] | None], pipe: Pipeline) -> None:
    result = queue(pipe)
    if inspect.iscoroutine(result):  # not a pipeline a lambda returned (awaiting one resets it)
        await result


async def _wait_after_write(r: Redis, key: str) -> int:
    """A write in `key`'s slot, then WAIT, on one connection to the slot's master now."""
    fence = keys.replication_fence_key(key)
    async with r.pipeline(transaction=False) as pipe:
        pipe.set(fence, "1", px=60_000)
        pipe.execute_command("WAIT", REPLICAS, ACK_TIMEOUT_MS, target_nodes=node_of(r, fence))
        _, acked = await pipe.execute()
    return int(acked)


def _not_acknowledged(what: str, acked: int) -> None:
    _warned["since"] += 1
    now = time.monotonic()
    if now - _warned["at"] >= WARN_EVERY_S:
        log.warning(
            "a write was not acknowledged by a replica in time: it stands, but a failover now could lose it",
            what=what,
            acked=acked,
            wanted=REPLICAS,
            timeout_ms=ACK_TIMEOUT_MS,
            since_last_warning=_warned["since"],
        )
        _warned["at"], _warned["since"] = now, 0
