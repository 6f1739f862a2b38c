"""Sleeping until a precise moment, on `time.monotonic()`.

Two traps this avoids: event-loop timers wake up to ~1 ms late (millisecond resolution), and
uvloop's ``loop.time()`` is libuv's cached *millisecond* clock, so it cannot even tell that the
moment has come. The broker promises deliveries within 1 ms of the emulated arrival time and
the workers pad compute to profiled durations, so both use this: sleep on a timer until shortly
before the moment, then yield to the loop until ``time.monotonic()`` reaches it (other tasks
keep running meanwhile).
"""

from __future__ import annotations

import asyncio
import time

#: Wake this long before the deadline with a timer, then yield until the deadline.
SPIN_S = 0.002


async def sleep_until(when: float, *, wake: asyncio.Event | None = None) -> bool:
    """Sleep until monotonic time `when`; return early (True) if `wake` is set first, else False."""
    coarse = when - time.monotonic() - SPIN_S
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
    while time.monotonic() < when:
        if wake is not None and wake.is_set():
            return True
        await asyncio.sleep(0)
    return wake is not None and wake.is_set()
