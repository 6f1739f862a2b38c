"""`bubbletea train --save`: the stop after a chosen iteration, and the state handed to the launcher.

Every worker finishes the same iteration before a clean stop (the launcher names it in Redis), so
the save holds one iteration; replica 0 of each stage hands its weights and trainer state over
through the port, for the launcher to write the save directory.

Tests: tests/e2e/test_train_save.py.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from redis.asyncio import Redis

from services.stage_worker.port.stage_port import StagePort
from services.stage_worker.train.trainer import StageTrainer
from shared.runtime.logs import get_logger
from shared.wire import keys

log = get_logger(__name__)


async def stop_requested(redis: Redis, run: str, it: int) -> bool:
    """Whether the launcher asked run `run` to stop after iteration `it`."""
    value = await redis.get(keys.stop_after_key(run))
    return value is not None and it >= int(value)


async def hand_over_state(
    port: StagePort, trainer: StageTrainer, in_torch_thread: Callable[..., Awaitable[Any]], slot: str, it: int
) -> None:
    """Hand this stage's weights (named as the saved checkpoint stores them) and its trainer
    checkpoint after iteration `it` over through the port (every replica holds the same state
    after the step); the trainer's work runs in the stage's torch thread."""
    from safetensors.torch import save

    weights, state = await in_torch_thread(lambda: (save(trainer.saved_tensors()), trainer.checkpoint()))
    await port.hand_over(it, weights, state)
    log.info("state handed over for the save", slot=slot, iteration=it, bytes=len(weights) + len(state))
