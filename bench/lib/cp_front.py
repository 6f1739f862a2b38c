"""A front door for bench/control_plane.py, in a process of its own: Poisson requests accepted
with the front door's own script (`bench/lib/injector.py`), and its results stream read as a front
door reads its answers (XREAD, blocking), until `until`.

    python bench/lib/cp_front.py CONFIG_JSON

CONFIG_JSON: url, run, rate, instance (the front door's name), prefix, seed, window (wall-clock
start and end of the measured window), until (wall clock), dcs (a dispatcher per datacenter: the
requests go to their streams in turn, not routed on their snapshots as the live front door does,
and their answers come on a results stream per datacenter, read each by its own XREAD as the live
front door's consumers do; else null). It prints one JSON object: requests sent, answers read, and
answers read in the window.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench.lib.injector import inject
from shared.bus.connection import client_for
from shared.wire import keys


async def answers(url: str, stream: str, until: float, window: tuple[float, float]) -> tuple[int, int]:
    """Answers read from `stream` until `until` (wall clock), and of them those read in `window`."""
    r = client_for(url)
    last, n, inside = "0-0", 0, 0
    try:
        while time.time() < until + 0.5:  # the last answers of what was sent
            reply: Any = await r.xread({stream: last}, count=1000, block=100)
            now = time.time()
            for _, entries in reply or []:
                n += len(entries)
                inside += len(entries) if window[0] <= now < window[1] else 0
                last = entries[-1][0]
    finally:
        await r.aclose()
    return n, inside


async def main(cfg: dict[str, Any]) -> dict[str, Any]:
    until, run, dcs = cfg["until"], cfg["run"], cfg.get("dcs")
    streams = {dc or "": keys.prefill_results_stream(run, cfg["instance"], dc) for dc in dcs or [None]}
    sending = inject(
        cfg["url"],
        run,
        cfg["rate"],
        time.monotonic() + (until - time.time()),
        streams if dcs else streams[""],
        cfg["prefix"],
        cfg["seed"],
        dcs,
    )
    reading = [answers(cfg["url"], stream, until, tuple(cfg["window"])) for stream in streams.values()]
    sent, *read = await asyncio.gather(sending, *reading)
    return {"sent": sent, "answers_read": sum(n for n, _ in read), "answers_in_window": sum(i for _, i in read)}


if __name__ == "__main__":
    print(json.dumps(asyncio.run(main(json.loads(sys.argv[1])))), flush=True)
