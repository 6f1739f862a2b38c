"""The stage port's saved state: the recovery checkpoints (`training.checkpoint_every`) and the state
a replica-0 worker hands over for `bubbletea train --save`.

Both are files under the run's state directory (`Settings.state_dir`, BUBBLETEA_STATE_DIR:
``<dir>/<run>/``), never Redis values: a checkpoint is a stage's weights and AdamW's moments, up to
three times the stage's size. Redis holds only **references**, the files' absolute paths:

* ``bt:{<run>}:ckpt:<r>:<k>`` (a hash, iteration -> path): which checkpoints slot (r, k) has, what the
  recovery protocol reads to pick the newest one every slot has (`Generations.resume_point`);
* ``bt:{<run>}:weights:<i>:<k>`` and ``bt:{<run>}:trainstate:<i>:<k>`` (strings, a path each): the state
  stage k handed over after iteration i, which the `bubbletea train --save` launcher reads (it
  starts the workers on its own host, so it reads their files) and deletes, files included.

A file is written whole (to a temporary name, then renamed) before its reference is, so a reader
never sees half of one. A replacement worker reads its slot's checkpoint from the path its dead
predecessor wrote: on one host any directory does; workers on several hosts that may replace each
other need one directory every host shares (docs/deploy.md).

Tested by: tests/integration/test_recovery_generations.py, tests/e2e/test_train_save.py,
tests/e2e/test_worker_recovery.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from redis.asyncio import Redis

from services.stage_worker.membership.lease import Slot, SlotError
from shared.policies.recovery import superseded
from shared.wire import keys


def write_file(path: Path, data: bytes) -> None:
    """Write `data` to `path` whole: a temporary file in the same directory, then a rename."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _unlink(paths: Iterable[str]) -> None:
    for p in paths:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(p)


def run_state_dir(state_dir: Path, run: str) -> Path:
    """Where one run's checkpoints and handed-over state live."""
    return state_dir / run


class CheckpointStore:
    """Every slot's checkpoints: files under ``<run dir>/ckpt/``, referenced from a Redis hash per
    slot (iteration -> path); each slot keeps its newest `keys.CHECKPOINTS_KEPT`."""

    def __init__(self, r: Redis, run: str, slots: Iterable[Slot], directory: Path) -> None:
        self.r, self.run = r, run
        self.slots = list(slots)
        self.directory = run_state_dir(directory, run) / "ckpt"

    def _key(self, s: Slot) -> str:
        return keys.checkpoint_key(self.run, s.replica, s.stage)

    def path(self, s: Slot, iteration: int) -> Path:
        return self.directory / s.name / f"{iteration}.safetensors"

    async def save(self, slot: Slot, iteration: int, blob: bytes) -> None:
        """Store `slot`'s checkpoint of `iteration`, keep its newest `CHECKPOINTS_KEPT` (the older
        files go with their references), and keep the run's generation counter alive as long as
        the run checkpoints."""
        key, path = self._key(slot), self.path(slot, iteration)
        await asyncio.to_thread(write_file, path, blob)
        have: dict[Any, Any] = await self.r.hgetall(key)
        old = superseded([*(int(f) for f in have), iteration], keys.CHECKPOINTS_KEPT)
        async with self.r.pipeline(transaction=True) as pipe:
            pipe.hset(key, str(iteration), str(path))
            if old:
                pipe.hdel(key, *[str(i) for i in old])
            pipe.expire(key, keys.RUN_STATE_TTL_S)
            pipe.expire(keys.generation_key(self.run), keys.RUN_STATE_TTL_S)
            await pipe.execute()
        gone = [v.decode() for f, v in have.items() if int(f) in old and v.decode() != str(path)]
        await asyncio.to_thread(_unlink, gone)

    async def load(self, slot: Slot, iteration: int) -> bytes:
        ref: Any = await self.r.hget(self._key(slot), str(iteration))
        if ref is None:
            raise SlotError(f"the checkpoint of iteration {iteration} of slot {slot.name} is gone (expired?)")
        path = Path(ref.decode())
        try:
            return await asyncio.to_thread(path.read_bytes)
        except OSError as exc:
            raise SlotError(
                f"the checkpoint of iteration {iteration} of slot {slot.name} is not readable at {path} ({exc}); "
                "workers that replace each other across hosts need one shared BUBBLETEA_STATE_DIR"
            ) from None

    async def iterations(self) -> dict[str, list[int]]:
        """Which iterations each slot has a checkpoint of."""
        async with self.r.pipeline(transaction=False) as pipe:
            for s in self.slots:
                pipe.hkeys(self._key(s))
            found = await pipe.execute()
        return {s.name: [int(f) for f in fields] for s, fields in zip(self.slots, found, strict=True)}


@dataclass
class StatePort:
    redis: Redis
    run: str
    slot: Slot
    #: The state directory (BUBBLETEA_STATE_DIR): this run's files go under `<state_dir>/<run>/`.
    state_dir: Path
    #: Every slot's checkpoints (None: the run does not checkpoint).
    checkpoints: CheckpointStore | None = None

    def _store(self) -> CheckpointStore:
        assert self.checkpoints is not None, "this run does not checkpoint"
        return self.checkpoints

    async def save_checkpoint(self, iteration: int, blob: bytes) -> None:
        await self._store().save(self.slot, iteration, blob)

    async def load_checkpoint(self, iteration: int) -> bytes:
        return await self._store().load(self.slot, iteration)

    async def checkpoint_iterations(self) -> dict[str, list[int]]:
        return await self._store().iterations()

    async def hand_over(self, iteration: int, weights: bytes, state: bytes) -> None:
        """Leave the stage's weights (named as the saved checkpoint stores them) and its trainer
        checkpoint after `iteration` for the launcher, which writes the save directory from them:
        two files under ``<run dir>/save/<iteration>/``, their paths in `keys.weights_key` and
        `keys.train_state_key` (the launcher deletes both once read)."""
        stage, folder = self.slot.stage, run_state_dir(self.state_dir, self.run) / "save" / str(iteration)
        w_path, s_path = folder / f"weights-s{stage}.safetensors", folder / f"trainstate-s{stage}.safetensors"
        await asyncio.to_thread(write_file, w_path, weights)
        await asyncio.to_thread(write_file, s_path, state)
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.set(keys.weights_key(self.run, iteration, stage), str(w_path), ex=keys.WEIGHTS_TTL_S)
            pipe.set(keys.train_state_key(self.run, iteration, stage), str(s_path), ex=keys.WEIGHTS_TTL_S)
            await pipe.execute()
