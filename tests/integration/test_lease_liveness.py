"""A spare takes a killed worker's slot as soon as Redis has seen its connections close, before its
lease expires; a live holder whose connections were closed under it keeps its slot
(`shared.policies.lease_liveness`, `SlotLease.liveness`). Real redis-server, a real holder process."""

from __future__ import annotations

import asyncio
import signal
import sys
import time
from typing import Any

from redis.asyncio import Redis, RedisCluster

from services.stage_worker.membership.lease import Slot, SlotLease
from shared.bus.connection import client_for, command_client
from shared.control.leases import holder_client_name
from shared.wire import keys

#: A stage worker's lease, alone: its connections named for the holder, renewed every second.
HOLDER = """
import asyncio, os, sys
from services.stage_worker.membership.lease import SlotLease
from shared.bus.connection import command_client
from shared.control.leases import holder_client_name

async def main(url, run, holder):
    try:  # ahead of the suite's other processes: resumed from a stall, it runs at once (as root)
        os.nice(-10)
    except OSError:
        pass
    lease = SlotLease(command_client(url, name=holder_client_name(holder)), run, 1, 1, holder)
    await lease.acquire()
    print("held", flush=True)
    await lease.watch()

asyncio.run(main(*sys.argv[1:]))
"""


def spare_of(redis: Redis, run: str) -> SlotLease:
    """A spare on `redis`, whose connections must carry its name as a worker's do (else it cannot see
    itself in CLIENT LIST, and turns the check off)."""
    spare = SlotLease(redis, run, 1, 1, "spare", liveness=True)
    spare.holders.settle_s = 0  # the suite's Redis may have started moments ago
    return spare


def named(url: str) -> Redis:
    return command_client(url, name=holder_client_name("spare"))


async def test_a_spare_takes_a_killed_workers_slot_before_its_lease_expires(redis: Redis, redis_url: str) -> None:
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-c", HOLDER, redis_url, "kill", "h1", stdout=asyncio.subprocess.PIPE
    )
    try:
        assert await asyncio.wait_for(proc.stdout.readline(), 30) == b"held\n"  # type: ignore[union-attr]
        spare = spare_of(spare_redis := named(redis_url), "kill")
        waiting = asyncio.create_task(spare.wait_as_spare(asyncio.Event(), poll_s=0.05))
        await asyncio.sleep(2.5)  # more than two renewals: a live, connected holder keeps its slot
        assert not waiting.done()
        proc.kill()
        await proc.wait()
        killed = time.monotonic()
        left_s = await redis.pttl(keys.lease_key("kill", 0, 0)) / 1000  # what its lease had left
        assert left_s > 1.0
        assert await asyncio.wait_for(waiting, 10) == Slot(0, 0)
        # taken while the dead holder's lease still had time to run: the closed connections told
        assert time.monotonic() - killed < left_s, f"taken {time.monotonic() - killed:.2f} s after the kill"
        assert await redis.get(keys.lease_key("kill", 0, 0)) == b"spare"
        await spare_redis.aclose()
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()


async def test_a_live_holder_stalled_past_the_grace_with_its_connection_closed_keeps_its_slot(
    redis: Redis, redis_url: str
) -> None:
    """Issue 62: one look of a spare's took a live worker for gone after its connection closed under
    it and its event loop stalled past the 0.3 s grace (a GC pause, a graph capture). Two looks a
    renewal apart, with no renewal between, do not: here it is stopped 1.45 s just after a renewal,
    its connection closed, and it keeps its slot.

    A loaded suite can stretch the stall itself (this test's own loop sends the SIGCONT late): a try
    whose holder was stopped longer than `STALL_S` + `STALL_SLACK_S` since its renewal (as Redis saw
    it) is not the case under test, and is tried again (at most `STALL_TRIES`); one stopped as
    meant must keep its slot."""
    for attempt in range(STALL_TRIES):
        kept, stalled_s = await _stalled_once(redis, redis_url, f"stall-{attempt}")
        if stalled_s <= STALL_S + STALL_SLACK_S:
            assert kept, f"stopped {stalled_s:.2f} s after its renewal, it lost its slot"
            return
    raise AssertionError(f"no try stopped the holder for {STALL_S} s as meant: the last {stalled_s:.2f} s")


#: The holder is stopped this long from its renewal: past a renewal interval and the grace (the
#: spare's first look, 1.3 s, takes it for gone), well before its second look (2.3 s), which rightly
#: frees a holder still silent then. At 1.6 s a loaded suite's holder, resumed, took more than the
#: 0.7 s left to reconnect and renew (a fresh-clone run, 2026-12-07); at 1.45 s the SIGCONT itself
#: went out late on a slower day, hence the check of how long the stop really was.
STALL_S = 1.45
STALL_SLACK_S = 0.25
STALL_TRIES = 3


async def _stalled_once(redis: Redis, redis_url: str, run: str) -> tuple[bool, float]:
    """One try: the holder of `run`'s slot stopped `STALL_S` from a renewal, its connection closed;
    whether it kept its slot, and how long it was really stopped from that renewal (by its TTL)."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-c", HOLDER, redis_url, run, "h4", stdout=asyncio.subprocess.PIPE
    )
    spare_redis = named(redis_url)
    loop = asyncio.get_running_loop()
    try:
        assert await asyncio.wait_for(proc.stdout.readline(), 30) == b"held\n"  # type: ignore[union-attr]
        spare = spare_of(spare_redis, run)
        waiting = asyncio.create_task(spare.wait_as_spare(asyncio.Event(), poll_s=0.05))
        key = keys.lease_key(run, 0, 0)
        start = await redis.pttl(key)
        while (left := await redis.pttl(key)) <= start:  # noqa: ASYNC110 (a TTL: nothing to wait on)
            await asyncio.sleep(0.01)
        renewed = loop.time() - (keys.LEASE_TTL_MS - left) / 1000  # when it renewed, by its TTL
        proc.send_signal(signal.SIGSTOP)
        for c in await redis.client_list(_type="normal"):
            if c["name"] == holder_client_name("h4"):
                await redis.client_kill_filter(_id=c["id"])
        await asyncio.sleep(max(0.0, renewed + STALL_S - loop.time()))
        proc.send_signal(signal.SIGCONT)
        stalled_s = loop.time() - renewed
        await asyncio.sleep(2.0)  # it reconnects and renews; the spare looks on
        kept = not waiting.done() and await redis.get(key) == b"h4"
        waiting.cancel()
        await asyncio.gather(waiting, return_exceptions=True)
        return kept, stalled_s
    finally:
        await spare_redis.aclose()
        if proc.returncode is None:
            proc.send_signal(signal.SIGCONT)
            proc.kill()
            await proc.wait()


async def test_a_live_holder_whose_connections_are_closed_under_it_keeps_its_slot(redis: Redis, redis_url: str) -> None:
    client = command_client(redis_url, name=holder_client_name("h2"))
    holder = SlotLease(client, "cut", 1, 1, "h2")
    await holder.acquire()
    watch = asyncio.create_task(holder.watch())
    spare_redis = named(redis_url)
    spare = spare_of(spare_redis, "cut")
    waiting = asyncio.create_task(spare.wait_as_spare(asyncio.Event(), poll_s=0.05))
    try:
        for _ in range(4):  # a server-side timeout or a network drop, again and again
            for c in await redis.client_list(_type="normal"):
                if c["name"] == holder_client_name("h2"):
                    await redis.client_kill_filter(_id=c["id"])
            await asyncio.sleep(1.0)
        assert not waiting.done() and not watch.done()  # it reconnected at its next renewal
        assert await redis.get(keys.lease_key("cut", 0, 0)) == b"h2"
    finally:
        for task in (waiting, watch):
            task.cancel()
        await asyncio.gather(waiting, watch, return_exceptions=True)
        await client.aclose()
        await spare_redis.aclose()


async def test_a_redis_that_refuses_client_list_leaves_the_expiry_to_free_the_slot(
    redis: Redis, redis_url: str
) -> None:
    everywhere: dict[str, Any] = {"target_nodes": RedisCluster.ALL_NODES} if isinstance(redis, RedisCluster) else {}
    await redis.execute_command("ACL", "SETUSER", "nolist", "on", ">pw", "~*", "+@all", "-client", **everywhere)
    limited = client_for(redis_url.replace("://", "://nolist:pw@", 1), socket_timeout=None)
    try:
        await SlotLease(redis, "acl", 1, 1, "h3").acquire()
        spare = spare_of(limited, "acl")
        stop = asyncio.Event()
        waiting = asyncio.create_task(spare.wait_as_spare(stop, poll_s=0.05))
        await asyncio.sleep(0.5)
        assert spare.liveness is False  # turned off, with a warning; the spare waits on
        assert not waiting.done()
        await redis.delete(keys.lease_key("acl", 0, 0))  # the lease expires
        assert await asyncio.wait_for(waiting, 5) == Slot(0, 0)
    finally:
        await redis.execute_command("ACL", "DELUSER", "nolist", **everywhere)
        await limited.aclose()


async def test_a_spare_that_cannot_see_its_own_connection_leaves_the_expiry_to_free_the_slot(
    redis: Redis, redis_url: str
) -> None:
    """Behind a proxy or on a cluster CLIENT LIST does not show a worker's connections: a spare that
    does not see its own there would take every holder for gone; it turns the check off instead."""
    await SlotLease(redis, "blind", 1, 1, "h5").acquire()
    spare = spare_of(redis, "blind")  # the suite's client: not named for the spare
    stop = asyncio.Event()
    waiting = asyncio.create_task(spare.wait_as_spare(stop, poll_s=0.05))
    try:
        async with asyncio.timeout(10):
            while spare.liveness:  # noqa: ASYNC110 (a flag the spare's first look sets)
                await asyncio.sleep(0.05)
        assert not waiting.done() and await redis.get(keys.lease_key("blind", 0, 0)) == b"h5"
    finally:
        stop.set()
        await asyncio.gather(waiting, return_exceptions=True)
