"""Our Redis clients must never swallow a task cancellation (see shared/bus/connection.py)."""

from __future__ import annotations

import asyncio

import pytest

from shared.bus.connection import blocking_client, command_client


@pytest.mark.parametrize("make", [command_client, blocking_client])
async def test_cancelling_a_busy_client_always_cancels(redis_url: str, make: object) -> None:
    r = make(redis_url)  # type: ignore[operator]
    await r.ping()
    swallowed = 0
    for i in range(200):

        async def busy() -> None:
            for _ in range(10_000):
                await r.set("k", "v")

        task = asyncio.create_task(busy())
        for _ in range(i % 7):  # cancel at varying points of the command cycle
            await asyncio.sleep(0)
        task.cancel()
        try:
            await task
            swallowed += 1
        except asyncio.CancelledError:
            pass
    await r.aclose()
    assert swallowed == 0, f"{swallowed} of 200 cancellations were swallowed"
