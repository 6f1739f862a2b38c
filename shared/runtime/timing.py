"""Sleeping until a precise moment, on `time.monotonic()`; and keeping padded work on its profiled
schedule (`Schedule`).

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


class Schedule:
    """A run of profiled steps padded to one schedule, as an emulated device runs them: step i is
    due at the run's start plus the profiled times of steps 0..i.

    The caller waits until the previous step is due before starting the next one (`wait_s`), so a
    step that ends early counts for its whole profiled time, and one that ends late starts the
    next steps late while the slack of faster steps wins that back. So the run takes its profiled
    total whenever the real work (profiled, and unprofiled work between steps such as a prompt's
    embedding and head) keeps up on average, rather than the profile plus every wait's wake-up
    delay and every slow step's overrun, which padding each step on its own adds up (on a busy
    2-core machine that doubled a prefill batch's time). Pure: the caller reads the clock and
    sleeps."""

    def __init__(self, start: float) -> None:
        self.due = start

    def add(self, profiled_s: float) -> None:
        """A step of `profiled_s` started: the run is due that much later."""
        self.due += profiled_s

    def wait_s(self, now: float) -> float:
        """Seconds until the steps so far are due at `now` (0 when behind)."""
        return max(0.0, self.due - now)

    def behind(self, now: float) -> float:
        """How far the run is behind its schedule at `now` (0 when on time)."""
        return max(0.0, now - self.due)
