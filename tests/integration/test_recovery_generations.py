"""The recovery generations over a real redis-server: peers noticing a loss together and a
replacement arriving meanwhile end in one generation, resuming from one checkpoint."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from redis.asyncio import Redis

from services.stage_worker.membership.generations import Generations
from services.stage_worker.membership.lease import Slot, SlotError
from services.stage_worker.port.state import CheckpointStore
from shared.policies.recovery import Resume, Source
from shared.wire import keys

SLOTS = [Slot(0, 0), Slot(0, 1), Slot(1, 0), Slot(1, 1)]


async def test_peers_and_a_replacement_converge_on_one_generation_and_resume_point(
    redis: Redis, tmp_path: Path
) -> None:
    run = "gen1"
    store = CheckpointStore(redis, run, SLOTS, tmp_path)
    for s in SLOTS:  # every slot checkpointed iteration 1; all but r1s1 also iteration 3
        await store.save(s, 1, b"one")
        if s != Slot(1, 1):
            await store.save(s, 3, b"three")
    assert (await store.iterations())["r1s1"] == [1]

    # every slot trained in generation 1; r1s1 died; its replacement starts while the peers notice
    start = [Generations(redis, run, SLOTS) for _ in SLOTS]
    await asyncio.gather(*(g.enter(after_loss=False) for g in start))
    peers = start[:3]
    for g in peers:
        g.member.generation = 1  # they trained in generation 1
    await redis.set(keys.generation_key(run), 1)
    replacement = Generations(redis, run, SLOTS)

    moved_on: list[Generations] = []
    all_moved_on = asyncio.Event()

    async def peer(g: Generations, slot: Slot) -> tuple[int, Resume]:
        await g.enter(after_loss=True)
        moved_on.append(g)
        if len(moved_on) == len(peers):
            all_moved_on.set()
        gen = await g.barrier(slot, timeout_s=60)
        return gen, await g.resume_point(store.iterations)

    async def newcomer() -> tuple[int, Resume]:
        # it arrives after the peers moved on together (and before their barrier, which waits for it)
        await asyncio.wait_for(all_moved_on.wait(), 60)
        await replacement.enter(after_loss=False)
        gen = await replacement.barrier(Slot(1, 1), timeout_s=60)
        return gen, await replacement.resume_point(store.iterations)

    results = await asyncio.gather(*(peer(g, s) for g, s in zip(peers, SLOTS, strict=False)), newcomer())
    assert len(set(results)) == 1, results  # one generation, one resume point
    gen, resume = results[0]
    assert gen == 3  # the peers moved 1 -> 2 once (not three times), the replacement 2 -> 3
    # no worker said it holds a newer state (each says -1 here): the newest checkpoint every slot has
    # (r1s1 never wrote iteration 3); tests/unit/test_recovery.py has the plans from live state
    assert resume == Resume(1, Source.CHECKPOINT)


async def test_a_slot_keeps_its_newest_two_checkpoints(redis: Redis, tmp_path: Path) -> None:
    store = CheckpointStore(redis, "gen3", SLOTS, tmp_path)
    for it in (1, 3, 5):
        await store.save(Slot(0, 0), it, str(it).encode())
    assert sorted((await store.iterations())["r0s0"]) == [3, 5]
    assert await store.load(Slot(0, 0), 5) == b"5"
    with pytest.raises(SlotError, match="iteration 1 of slot r0s0 is gone"):
        await store.load(Slot(0, 0), 1)
    # the checkpoints are files under the run's state directory; Redis holds their paths only
    kept = sorted(p.name for p in (tmp_path / "gen3" / "ckpt" / "r0s0").iterdir())
    assert kept == ["3.safetensors", "5.safetensors"]  # the superseded file went with its reference
    refs = await redis.hgetall(keys.checkpoint_key("gen3", 0, 0))
    assert {int(f): v.decode() for f, v in refs.items()} == {i: str(store.path(Slot(0, 0), i)) for i in (3, 5)}


async def test_a_checkpoint_whose_file_is_gone_fails_naming_the_shared_directory(redis: Redis, tmp_path: Path) -> None:
    store = CheckpointStore(redis, "gen4", SLOTS, tmp_path)
    await store.save(Slot(1, 1), 2, b"two")
    store.path(Slot(1, 1), 2).unlink()  # e.g. written on another host, into a directory this one lacks
    with pytest.raises(SlotError, match=r"iteration 2 of slot r1s1 is not readable at .*BUBBLETEA_STATE_DIR"):
        await store.load(Slot(1, 1), 2)


async def test_a_barrier_nobody_completes_times_out_naming_the_missing_slots(redis: Redis) -> None:
    g = Generations(redis, "gen2", SLOTS)
    await g.enter(after_loss=False)
    with pytest.raises(SlotError, match=r"waiting for workers of slots r0s1, r1s0, r1s1"):
        await g.barrier(Slot(0, 0), timeout_s=0.2)


async def test_a_worker_training_in_an_old_generation_wakes_on_the_move_not_at_its_next_look(
    redis: Redis, redis_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A replacement entering announces its generation: a peer's `moved` returns at once, long
    before its next look at the counter (here never: LOOK_S is a minute)."""
    from services.stage_worker.membership import generations

    monkeypatch.setattr(generations, "LOOK_S", 60.0)
    peer = Generations(redis, "wake", SLOTS, url=redis_url, name="stage_worker:peer")
    await peer.enter(after_loss=False)
    watching = asyncio.create_task(peer.moved())
    await asyncio.sleep(0.3)  # its reader is blocked on the stream now
    assert not watching.done()
    await Generations(redis, "wake", SLOTS).enter(after_loss=False)  # a replacement joins
    await asyncio.wait_for(watching, 5)
    assert await peer.read() == peer.current + 1
    # the reader's connection is closed with the watch
    assert not [c for c in await redis.client_list(_type="normal") if c["name"] == "stage_worker:peer"]


async def test_without_a_reader_a_move_is_seen_at_the_next_look(redis: Redis, monkeypatch: pytest.MonkeyPatch) -> None:
    from services.stage_worker.membership import generations

    monkeypatch.setattr(generations, "LOOK_S", 0.05)
    peer = Generations(redis, "look", SLOTS)  # no url: it only looks
    await peer.enter(after_loss=False)
    watching = asyncio.create_task(peer.moved())
    await asyncio.sleep(0.2)
    assert not watching.done()
    await redis.incr(keys.generation_key("look"))  # a move nobody announced
    await asyncio.wait_for(watching, 5)
