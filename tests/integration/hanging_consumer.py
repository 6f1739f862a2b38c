"""A consumer process that takes entries and never finishes them; the test SIGKILLs it.

Usage: python hanging_consumer.py REDIS_URL STREAM GROUP N
Prints "took N" once it holds N entries, then waits forever.
"""

import asyncio
import sys

from shared.bus import Bus, Delivery
from shared.config.spec import BusConfig
from shared.wire import Ping


async def main(url: str, stream: str, group: str, n: int) -> None:
    taken = 0
    forever = asyncio.Event()

    async def hang(_: Delivery) -> None:
        nonlocal taken
        taken += 1
        if taken == n:
            print(f"took {n}", flush=True)
        await forever.wait()

    async with Bus(url, BusConfig(concurrency=n)) as bus, bus.consumer(stream, group, {Ping: hang}, name="doomed"):
        await forever.wait()


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])))
