"""Slot leases against a real redis-server: exclusive, renewable, and loss is detected."""

from __future__ import annotations

import asyncio

import pytest
from redis.asyncio import Redis

from services.stage_worker.membership.lease import Slot, SlotError, SlotLease
from shared.wire import keys
from shared.wire.status import LeaseState


async def test_every_slot_goes_to_exactly_one_worker(redis: Redis) -> None:
    leases = [SlotLease(redis, "r1", pp=2, dp=2, holder=f"w{i}") for i in range(4)]
    slots = [await lease.acquire() for lease in leases]
    assert sorted((s.replica, s.stage) for s in slots) == [(0, 0), (0, 1), (1, 0), (1, 1)]
    with pytest.raises(SlotError, match="all 4 slots of run 'r1'"):
        await SlotLease(redis, "r1", pp=2, dp=2, holder="w4").acquire()
    # another run has its own slots
    assert await SlotLease(redis, "r2", pp=2, dp=2, holder="x").acquire() == Slot(0, 0)


async def test_concurrent_acquires_never_share_a_slot(redis: Redis) -> None:
    leases = [SlotLease(redis, "race", pp=3, dp=3, holder=f"w{i}") for i in range(12)]
    results = await asyncio.gather(*(lease.acquire() for lease in leases), return_exceptions=True)
    won = [r for r in results if isinstance(r, Slot)]
    assert len(won) == 9 and len(set(won)) == 9
    assert sum(isinstance(r, SlotError) for r in results) == 3


async def test_renew_fails_once_the_lease_is_gone_and_a_freed_slot_is_reused(redis: Redis) -> None:
    a = SlotLease(redis, "r", pp=1, dp=1, holder="a")
    await a.acquire()
    await a.renew()
    assert 0 < await redis.pttl(keys.lease_key("r", 0, 0)) <= keys.LEASE_TTL_MS
    await redis.delete(keys.lease_key("r", 0, 0))  # as if it expired while the worker was frozen
    b = SlotLease(redis, "r", pp=1, dp=1, holder="b")
    assert await b.acquire() == Slot(0, 0)  # a replacement takes the slot over
    with pytest.raises(SlotError, match="lost the lease of slot r0s0"):
        await a.renew()
    await a.release()  # must not delete b's lease
    assert await redis.get(keys.lease_key("r", 0, 0)) == b"b"


async def test_barrier_and_peer_loss(redis: Redis) -> None:
    a = SlotLease(redis, "p", pp=2, dp=1, holder="a")
    b = SlotLease(redis, "p", pp=2, dp=1, holder="b")
    await a.acquire()
    barrier = asyncio.create_task(a.wait_for_all(timeout_s=60))
    await b.acquire()
    await asyncio.wait_for(barrier, 60)
    alone = SlotLease(redis, "q", pp=2, dp=1, holder="c")
    await alone.acquire()
    with pytest.raises(SlotError, match="timed out after 0s waiting for workers of slots r0s1"):
        await alone.wait_for_all(timeout_s=0)
    watch = asyncio.create_task(a.watch())
    await b.release()  # b's process "died": its lease is gone and it left no done marker
    with pytest.raises(SlotError, match="slot r0s1 lost its worker"):
        await asyncio.wait_for(watch, 60)


async def test_a_finished_peer_is_not_a_failure(redis: Redis) -> None:
    a = SlotLease(redis, "f", pp=2, dp=1, holder="a")
    b = SlotLease(redis, "f", pp=2, dp=1, holder="b")
    await a.acquire()
    await b.acquire()
    await a.wait_for_all(timeout_s=60)
    await b.finish()
    assert await a._missing() == []


async def test_an_aborting_peer_passes_on_the_original_reason(redis: Redis) -> None:
    a = SlotLease(redis, "c", pp=2, dp=1, holder="a")
    b = SlotLease(redis, "c", pp=2, dp=1, holder="b")
    await a.acquire()
    await b.acquire()
    await a.wait_for_all(timeout_s=60)
    await b.abort("slot r9s9 lost its worker (its lease expired): the run cannot continue")
    await b.release()
    with pytest.raises(SlotError, match="slot r9s9 lost its worker"):
        await asyncio.wait_for(a.watch(), 60)


async def test_a_worker_of_one_datacenter_takes_only_its_slots(redis: Redis) -> None:
    """BUBBLETEA_DC: stages 0 and 1 in one DC, stage 2 in another; its workers take only stage 2."""
    in_dc_b = lambda s: s.stage == 2  # noqa: E731 - the placement's answer, as the worker asks it
    got = [await SlotLease(redis, "dc", pp=3, dp=2, holder=f"b{i}").acquire(allowed=in_dc_b) for i in range(2)]
    assert got == [Slot(0, 2), Slot(1, 2)]
    with pytest.raises(SlotError, match=r"\(2 of them in this worker's datacenter\) are held"):
        await SlotLease(redis, "dc", pp=3, dp=2, holder="b2").acquire(allowed=in_dc_b)
    # the other datacenter's slots are still free for its own workers
    assert await SlotLease(redis, "dc", pp=3, dp=2, holder="a0").acquire() == Slot(0, 0)


async def test_a_spare_takes_the_first_slot_that_frees_and_stops_when_told(redis: Redis) -> None:
    holders = [SlotLease(redis, "sp", pp=2, dp=1, holder=f"w{i}") for i in range(2)]
    for lease in holders:
        await lease.acquire()
    spare = SlotLease(redis, "sp", pp=2, dp=1, holder="spare")
    stop = asyncio.Event()
    waiting = asyncio.create_task(spare.wait_as_spare(stop, poll_s=0.05))
    await asyncio.sleep(0.3)
    assert not waiting.done()  # every slot is held: it waits instead of failing
    await holders[1].release()  # the slot's worker stopped (or its lease expired)
    assert await asyncio.wait_for(waiting, 5) == Slot(0, 1) == spare.slot
    assert await redis.get(keys.lease_key("sp", 0, 1)) == b"spare"

    second = SlotLease(redis, "sp", pp=2, dp=1, holder="spare2")
    waiting = asyncio.create_task(second.wait_as_spare(stop, poll_s=0.05))
    await asyncio.sleep(0.2)
    stop.set()
    assert await asyncio.wait_for(waiting, 5) is None and second.slot is None


async def test_a_spare_does_not_take_over_a_slot_that_finished_and_leaves_once_all_did(redis: Redis) -> None:
    """A slot whose worker ended `done` has nothing left to train: a spare that took it would wait
    for peers that are gone. It takes a slot freed otherwise, and leaves once every slot it could
    take is done."""
    holders = [SlotLease(redis, "fin", pp=2, dp=1, holder=f"w{i}") for i in range(2)]
    for lease in holders:
        await lease.acquire()
    spare = SlotLease(redis, "fin", pp=2, dp=1, holder="spare")
    waiting = asyncio.create_task(spare.wait_as_spare(asyncio.Event(), poll_s=0.05))
    await holders[0].finish()  # done: released, and not to be taken over
    await asyncio.sleep(0.3)
    assert not waiting.done() and await redis.get(keys.lease_key("fin", 0, 0)) is None
    await holders[1].finish()  # every slot finished: the spare leaves
    assert await asyncio.wait_for(waiting, 5) is None and spare.slot is None
    assert await redis.get(keys.lease_key("fin", 0, 1)) is None


async def test_a_dead_workers_lease_is_released_by_its_supervisor_and_only_its_own(redis: Redis) -> None:
    from shared.control.leases import release_dead

    a, b = SlotLease(redis, "dead", 1, 2, "host-1"), SlotLease(redis, "dead", 1, 2, "host-2")
    await a.acquire()
    await b.acquire()
    assert await release_dead(redis, "dead", 1, 2, "host-1") == ["r0s0"]  # host-1 died: its slot frees now
    assert await redis.get(keys.lease_key("dead", 0, 0)) is None
    assert await redis.get(keys.lease_key("dead", 1, 0)) == b"host-2"
    assert await release_dead(redis, "dead", 1, 2, "host-9") == []


async def test_a_drained_peer_is_noticed_at_once_and_its_slot_taken_by_a_spare(redis: Redis) -> None:
    from shared.wire.status import LeaseState

    peer, leaver = SlotLease(redis, "drain", 1, 2, "p", recoverable=True), SlotLease(redis, "drain", 1, 2, "l")
    await peer.acquire()
    await leaver.acquire()
    await peer.wait_for_all(5)
    await leaver.leave("slot r1s0 left the run after iteration 3 (drained)")
    assert (await peer.ended(Slot(1, 0)))[0] is LeaseState.LEFT
    watch = asyncio.create_task(peer.watch())
    try:
        await asyncio.wait_for(peer.peer_lost.wait(), 5)  # a lease renewal later, not a TTL
    finally:
        watch.cancel()
    spare = SlotLease(redis, "drain", 1, 2, "s", recoverable=True)
    assert await spare.acquire() == Slot(1, 0)  # free at once, and its end marker cleared
    assert (await spare.ended(Slot(1, 0)))[0] is None


async def test_a_holder_that_went_quiet_renews_before_it_handles_anything_and_learns_its_slot_is_gone(
    redis: Redis,
) -> None:
    """`fence` is free while the last renewal is recent (no round trip); once it is older than
    FENCE_AFTER_S (the worker was stalled, or cut off), it renews first: a lease still its own is
    kept, one another worker took raises SlotError."""
    from services.stage_worker.membership.lease import FENCE_AFTER_S

    a = SlotLease(redis, "fence", pp=1, dp=1, holder="a")
    await a.acquire()
    await a.fence()  # recent: nothing to check
    a.renewed_at -= FENCE_AFTER_S + 0.1  # quiet for a while; the lease is still its own
    await a.fence()
    assert 0 < await redis.pttl(keys.lease_key("fence", 0, 0)) <= keys.LEASE_TTL_MS
    await redis.set(keys.lease_key("fence", 0, 0), "spare")  # taken over meanwhile
    await a.fence()  # renewed just now: still free (the key cannot have been taken since)
    a.renewed_at -= FENCE_AFTER_S + 0.1
    with pytest.raises(SlotError, match="lost the lease of slot r0s0"):
        await a.fence()


async def test_a_worker_whose_slot_was_taken_leaves_no_end_marker_on_it(redis: Redis) -> None:
    """A worker that lost its lease (cut off, stalled) and stops says nothing of the slot: peers
    would read an ABORTED marker as its new holder's end and fail, naming the stale worker's loss."""
    a = SlotLease(redis, "end", pp=1, dp=1, holder="a")
    await a.acquire()
    await redis.set(keys.lease_key("end", 0, 0), "spare")  # taken over while a was away
    await a.abort("lost the lease of slot r0s0 (expired or taken over)")
    await a.mark_stopped("slot r0s0 was stopped")
    assert await a.ended(Slot(0, 0)) == (None, "")
    b = SlotLease(redis, "end2", pp=1, dp=1, holder="b")
    await b.acquire()
    await b.abort("slot r0s1 lost its worker")  # its own slot: said
    assert await b.ended(Slot(0, 0)) == (LeaseState.ABORTED, "slot r0s1 lost its worker")
