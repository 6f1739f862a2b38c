"""Sleeping until a precise moment on the event loop's clock.

Event-loop timers wake up to ~1 ms late (epoll has millisecond resolution). The broker promises
deliveries within 1 ms of the emulated arrival time, so it sleeps until shortly before the moment,
then yields to the loop until the moment has come: other tasks keep running meanwhile.
"""

from __future__ import annotations

import asyncio

#: Wake this long before the target with a timer, then yield until the target.
SPIN_S = 0.0015


async def sleep_until(when: float, *, wake: asyncio.Event | None = None) -> bool:
    """Sleep until loop time `when`; return early (True) if `wake` is set first, else False."""
    loop = asyncio.get_running_loop()
    coarse = when - loop.time() - SPIN_S
    if coarse > 0:
        if wake is None:
            await asyncio.sleep(coarse)
        else:
            try:
                async with asyncio.timeout(coarse):
                    await wake.wait()
                return True
            except TimeoutError:
                pass
    while loop.time() < when:
        if wake is not None and wake.is_set():
            return True
        await asyncio.sleep(0)
    return wake is not None and wake.is_set()
