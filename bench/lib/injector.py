"""The dispatcher bench's injector (bench/dispatcher.py): Poisson requests accepted straight into
Redis with the front door's own script, batched per wake-up. Run as a process of its own, so that
several can offer more than one Python process can (the dispatcher, not the injector, is to be the
limit: issue 62). It prints how many it sent.

    python bench/lib/injector.py REDIS_URL RUN RATE SECONDS REPLY_TO ID_PREFIX SEED
"""

from __future__ import annotations

import asyncio
import random
import sys
import time
from collections.abc import Mapping
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from shared.bus.connection import client_for
from shared.control import serving
from shared.wire import PrefillRequest

#: Requests accepted per round trip at most (the injector's own batching).
ACCEPT_BATCH = 200


async def inject(
    url: str,
    run: str,
    rate: float,
    until: float,
    reply_to: str | Mapping[str, str],
    prefix: str = "d",
    seed: int = 1,
    dcs: list[str] | None = None,
) -> int:
    """Poisson arrivals at `rate`/s until `until` (monotonic), each accepted for `run` with the front
    door's script, batched per wake-up; with `dcs` (a dispatcher per datacenter), onto their request
    streams in turn, each answered on `reply_to`'s stream for its datacenter (a front door's results
    stream in that datacenter's tag); how many were sent."""
    r = client_for(url)
    rng, n, sent = random.Random(seed), 0, 0
    due = time.monotonic()
    try:
        while time.monotonic() < until:
            now = time.monotonic()
            batch: list[tuple[PrefillRequest, str | None]] = []
            while due <= now and len(batch) < ACCEPT_BATCH:
                n += 1
                tokens = tuple(rng.randrange(256) for _ in range(rng.randint(64, 128)))
                now_s = time.time()
                dc = dcs[n % len(dcs)] if dcs else None
                to = reply_to if isinstance(reply_to, str) else reply_to[dc or ""]
                req = PrefillRequest(id=f"{prefix}{n}", model="m", tokens=tokens, submitted=now_s, reply_to=to)
                batch.append((req, dc))
                due += rng.expovariate(rate)
            if batch:
                async with r.pipeline(transaction=False) as pipe:
                    for req, dc in batch:
                        pipe.eval(*serving.accept_args(run, req, 10_000_000, None, dc))
                    await pipe.execute()
                sent += len(batch)
            await asyncio.sleep(max(0.0, min(due - time.monotonic(), 0.005)))
    finally:
        await r.aclose()
    return sent


def main(argv: list[str]) -> int:
    url, run, rate, seconds, reply_to, prefix, seed = argv
    sent = asyncio.run(inject(url, run, float(rate), time.monotonic() + float(seconds), reply_to, prefix, int(seed)))
    print(sent, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
