"""A generation that moves on while a worker forms its data-plane groups (issue 62): the worker
calls the formation off and joins the new generation, rather than wait the plane's whole timeout
for peers that went there, and fail with a SlotError; unless its own slot was taken meanwhile (it
was cut off from Redis, say): then it stops, and never joins beside its replacement.

One real stage worker (PP=2 x DP=1) over a real redis-server; this test plays its peer's slot
through Redis as a peer does (`SlotLease`, `Generations`): the peer passes the barrier with the
worker and never forms its end of the groups; a replacement then takes its slot and begins the next
generation, as one that started just as the barrier passed does.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path

from redis.asyncio import Redis

from bubbletea.launcher.procs import Proc, spawn, stop_all
from bubbletea.launcher.services import STAGE_WORKER
from services.stage_worker.membership.generations import Generations
from services.stage_worker.membership.lease import Slot, SlotLease
from shared.runtime.redis_server import EmbeddedRedis
from shared.wire import keys
from tests.e2e.serving import wait_until
from tests.e2e.test_training_correctness import ONE_REPLICA, write_spec

#: The slot this test holds: the first a lease takes, so the worker gets the other (r0s1).
PEER = Slot(0, 0)
#: How long the worker may take to start (import torch, build its stage) and pass the barrier.
START_S = 60.0
#: How long the worker may take to join the moved generation: a third of the data plane's 60 s
#: formation timeout (`DataPlane`), which a worker that misses the move waits out, then fails.
JOIN_S = 20.0
PP, DP = ONE_REPLICA["parallelism"]["pp"], ONE_REPLICA["parallelism"]["dp"]


@dataclass
class Forming:
    """A real worker (slot r0s1) forming generation `gen`'s groups, and the peer this test plays."""

    run: str
    gen: int
    worker: Proc
    out: io.StringIO
    peer: Generations
    renewing: asyncio.Task[None]  # the peer slot's lease, renewed (cancelled on the way out)
    codes: dict[str, int] = field(default_factory=dict)  # the worker's exit, once stopped


@contextlib.asynccontextmanager
async def worker_forming(tmp_path: Path, redis_server: EmbeddedRedis, redis: Redis) -> AsyncIterator[Forming]:
    """Start the worker; the peer starts as every worker does and passes the barrier with it; yield
    once the worker's end of generation g's rendezvous is in Redis (it is forming its groups, for a
    peer that never forms its own). The worker is stopped on the way out."""
    run = f"form{uuid.uuid4().hex[:6]}"
    path = write_spec(tmp_path, ONE_REPLICA, checkpoint_every=1, iterations=100)
    peer_lease = SlotLease(redis, run, PP, DP, holder="test-peer", recoverable=True)
    assert await peer_lease.acquire() == PEER
    renewing = asyncio.create_task(peer_lease.watch())
    out = io.StringIO()
    env = {"REDIS_URL": redis_server.url, "BUBBLETEA_CONFIG": str(path), "BUBBLETEA_RUN": run}
    worker = await spawn(STAGE_WORKER, env, out=out)
    f = Forming(run, 0, worker, out, Generations(redis, run, peer_lease.all_slots), renewing)
    try:
        await f.peer.enter(after_loss=False)
        f.gen = await f.peer.barrier(PEER, START_S)

        async def forming() -> bool:
            return bool(await redis.keys(keys.plane_prefix(run, f.gen) + "*"))

        await wait_until(forming, f"the worker forming generation {f.gen}'s groups", START_S)
        yield f
    finally:
        f.renewing.cancel()
        await asyncio.gather(f.renewing, return_exceptions=True)
        f.codes = await stop_all([worker])


async def test_a_worker_forming_its_groups_joins_the_next_generation_when_the_run_moves_on(
    tmp_path: Path, redis_server: EmbeddedRedis, redis: Redis
) -> None:
    async with worker_forming(tmp_path, redis_server, redis) as f:
        # the peer is lost before it forms; a replacement takes its slot and begins the next generation
        f.renewing.cancel()
        await asyncio.gather(f.renewing, return_exceptions=True)
        await redis.delete(keys.lease_key(f.run, PEER.replica, PEER.stage))
        replacement_lease = SlotLease(redis, f.run, PP, DP, holder="test-replacement", recoverable=True)
        assert await replacement_lease.acquire() == PEER
        f.renewing = asyncio.create_task(replacement_lease.watch())
        replacement = Generations(redis, f.run, replacement_lease.all_slots)
        assert await replacement.enter(after_loss=False) == f.gen + 1

        # the worker joins it: the replacement's barrier passes (a SlotError naming r0s1 otherwise)
        assert await replacement.barrier(PEER, JOIN_S) == f.gen + 1
        assert await redis.sismember(keys.generation_joined_key(f.run, f.gen + 1), "r0s1")
        log = f.out.getvalue()
        assert "the run's generation moved on while its groups formed: joining it" in log, log[-3000:]
        assert "could not join the data plane" not in log, log[-3000:]
        assert f.worker.proc.returncode is None, log[-3000:]
    assert f.codes == {STAGE_WORKER.name: 0}, f.out.getvalue()[-3000:]  # stopped while forming, no failure


async def test_a_worker_whose_slot_was_taken_does_not_join_the_next_generation(
    tmp_path: Path, redis_server: EmbeddedRedis, redis: Redis
) -> None:
    """As a worker on a partitioned host finds when the network heals (bench/faults.py lost-host:
    it joined the next generation beside the spare that took its slot): its lease another's and the
    generation moved on, both at once. It stops, naming the lost lease, and is not in the new
    generation; checked before it joins, not by the next renewal, which may be a second away."""
    async with worker_forming(tmp_path, redis_server, redis) as f:
        # its slot taken by a spare (as after a partition), and the run moved on: at once
        await redis.set(keys.lease_key(f.run, 0, 1), "test-spare-0", px=keys.LEASE_TTL_MS * 10)
        assert await f.peer.enter(after_loss=True) == f.gen + 1

        async def gone() -> bool:
            return f.worker.proc.returncode is not None

        await wait_until(gone, "the worker stopping, its slot another's", JOIN_S)
        log = f.out.getvalue()
        assert "lost the lease of slot r0s1" in log, log[-3000:]
        assert not await redis.sismember(keys.generation_joined_key(f.run, f.gen + 1), "r0s1"), log[-3000:]
        assert f.worker.proc.returncode != 0
