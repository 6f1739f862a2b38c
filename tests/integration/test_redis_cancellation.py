"""A task cancelled while it talks to Redis ends: no client we make swallows the cancellation.

Every service stops by cancelling tasks that may be in the middle of Redis commands (consumers,
heartbeats, lease renewals), and so do the tests; a swallowed cancellation leaves such a task
running, and whoever awaits it waits forever. With redis-py 8's default 5 s socket timeout every
write goes through `asyncio.wait_for`, which on Python 3.11 swallows a cancellation that lands as
the write completes (shared/bus/connection.py): measured here, 23 of 40 such cancels were lost. The
bus's clients set no socket timeout; the tests' `redis` fixture did not, and `test_readiness.py`'s
lease renewals then ran on after their cancel, about one run in twelve on a busy machine, until the
test timed out. Every client below sets none."""

from __future__ import annotations

import asyncio
import random
from collections.abc import Callable

import pytest
from redis.asyncio import Redis

from shared.bus.connection import blocking_client, command_client

CLIENTS: dict[str, Callable[[str], Redis]] = {"bus-commands": command_client, "bus-reader": blocking_client}


@pytest.mark.parametrize("client", CLIENTS)
async def test_a_task_cancelled_mid_command_ends(redis_url: str, client: str) -> None:
    r = CLIENTS[client](redis_url)
    try:
        await cancel_mid_commands(r)
    finally:
        await r.aclose()


async def test_a_task_of_a_test_cancelled_mid_command_ends(redis: Redis) -> None:
    await cancel_mid_commands(redis)


async def cancel_mid_commands(r: Redis, rounds: int = 40) -> None:
    """Start a task sending commands back to back, cancel it 0-3 ms later, `rounds` times: every
    one must end."""
    rng = random.Random(7)

    async def busy() -> None:
        while True:
            await r.ping()

    kept_running = 0
    for _ in range(rounds):
        task = asyncio.create_task(busy())
        await asyncio.sleep(rng.random() * 0.003)  # somewhere inside a command, or between two
        task.cancel()
        done, _ = await asyncio.wait({task}, timeout=5)
        if not done:
            kept_running += 1
            while not task.done():  # it ignored the cancel: stop it before the next round
                task.cancel()
                await asyncio.sleep(0.01)
    assert kept_running == 0, f"{kept_running} of {rounds} cancelled tasks went on with their commands"
