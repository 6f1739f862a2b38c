"""Emulated stage workers for bench/control_plane.py, in a process of their own (several such
processes drive more workers than one Python process can): each worker of `bench/lib/emulated_workers.py`
(bubbles announced, batches read, answered and reported), plus its slot's lease renewed every
`LEASE_RENEW_S` with the stage worker's own renewal script, one EVAL a worker.

    python bench/lib/cp_workers.py CONFIG_JSON

CONFIG_JSON: url, run, first, last (the workers' indices, of `total`), pp, period_s, bubble_s,
request_s, window (wall-clock start and end of the measured window), until (wall clock), stage_dcs
(each stage's datacenter), per_dc (each worker sends to its datacenter's dispatcher). It prints
one JSON object: in the window, bubble starts and ends, reports, batch arrivals and lease renewals;
and per bubble started in it with work waiting, start to that work's arrival (ms).
"""

from __future__ import annotations

import asyncio
import bisect
import json
import random
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench.lib.emulated_workers import Emulated, Shape
from services.stage_worker.membership.lease import _RENEW
from shared.bus.connection import client_for
from shared.wire import keys

HOLDER = "bench"


async def renew(url: str, run: str, workers: list[Emulated], stop: asyncio.Event, done: list[float]) -> None:
    """Each worker's lease (set before the dispatcher started) renewed every LEASE_RENEW_S (phases
    spread), one EVAL each."""
    r = client_for(url)
    try:

        async def one(w: Emulated) -> None:
            key = keys.lease_key(run, w.replica, w.stage)
            await asyncio.sleep(random.random() * keys.LEASE_RENEW_S)
            while not stop.is_set():
                await r.eval(_RENEW, 1, key, HOLDER, keys.LEASE_TTL_MS)
                done.append(time.time())
                await asyncio.sleep(keys.LEASE_RENEW_S)

        await asyncio.gather(*(one(w) for w in workers))
    finally:
        await r.aclose()


def start_to_work_ms(w: Emulated, t0: float, t1: float) -> tuple[list[float], int]:
    """Per bubble started in [t0, t1) with work waiting for it: its start to the first batch that
    arrived before the next bubble's start and holds a request accepted before this bubble began
    (ms). A request that arrives mid-bubble and is sent at once measures its own arrival, not the
    dispatcher's answer to the bubble: left out. Also how many bubbles started in the window."""
    out, n = [], 0
    for i, s in enumerate(w.starts):
        if not t0 <= s < t1:
            continue
        n += 1
        nxt = w.starts[i + 1] if i + 1 < len(w.starts) else float("inf")
        j = bisect.bisect_left(w.arrivals, s)
        while j < len(w.arrivals) and w.arrivals[j] < nxt:
            if w.arrival_oldest[j] < s:
                out.append(1000 * (w.arrivals[j] - s))
                break
            j += 1
    return out, n


async def main(cfg: dict[str, Any]) -> dict[str, Any]:
    shape = Shape(cfg["period_s"], cfg["bubble_s"], cfg["request_s"])
    pp, total, run, url = cfg["pp"], cfg["total"], cfg["run"], cfg["url"]
    dcs, per_dc = cfg["stage_dcs"], cfg["per_dc"]
    workers = [
        Emulated(run, i // pp, i % pp, dcs[i % pp], shape, i, total, url, dispatch_dc=dcs[i % pp] if per_dc else None)
        for i in range(cfg["first"], cfg["last"])
    ]
    stop, renewed = asyncio.Event(), []
    tasks = [asyncio.create_task(w.run_until(stop)) for w in workers]
    tasks.append(asyncio.create_task(renew(url, run, workers, stop, renewed)))
    await asyncio.sleep(max(0.0, cfg["until"] - time.time()))
    stop.set()
    await asyncio.gather(*tasks, return_exceptions=True)
    t0, t1 = cfg["window"]

    def within(xs: list[float]) -> int:
        return sum(1 for x in xs if t0 <= x < t1)

    waits: list[float] = []
    started = 0
    for w in workers:
        got, n = start_to_work_ms(w, t0, t1)
        waits += got
        started += n
    return {
        "bubble_starts": started,
        "bubble_ends": sum(within(w.ends) for w in workers),
        "reports": sum(within(w.reports) for w in workers),
        "batch_reads": sum(within(w.arrivals) for w in workers),
        "renewals": within(renewed),
        "answered": sum(w.answered for w in workers),
        "start_to_work_ms": [round(x, 3) for x in waits],
    }


if __name__ == "__main__":
    print(json.dumps(asyncio.run(main(json.loads(sys.argv[1])))), flush=True)
