"""The stage port's saved state: the recovery checkpoints (`training.checkpoint_every`) and the state
a replica-0 worker hands over for `bubbletea train --save`.
"""

from __future__ import annotations

from dataclasses import dataclass

from redis.asyncio import Redis

from services.stage_worker.lease import Slot
from services.stage_worker.recovery import CheckpointStore
from shared import keys


@dataclass
class StatePort:
    redis: Redis
    run: str
    slot: Slot
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
        checkpoint after `iteration` for the launcher, which writes the save directory from them."""
        stage = self.slot.stage
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.set(keys.weights_key(self.run, iteration, stage), weights, ex=keys.WEIGHTS_TTL_S)
            pipe.set(keys.train_state_key(self.run, iteration, stage), state, ex=keys.WEIGHTS_TTL_S)
            await pipe.execute()
