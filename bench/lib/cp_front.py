"""A front door for bench/control_plane.py, in a process of its own: Poisson requests accepted
with the front door's own script (`bench/lib/injector.py`), and its results stream read as a front
door reads its answers (XREAD, blocking), until `until`.

    python bench/lib/cp_front.py CONFIG_JSON

CONFIG_JSON: url, run, rate, reply_to, prefix, seed, window (wall-clock start and end of the
measured window), until (wall clock), dcs (a dispatcher per datacenter: the requests go to their
streams in turn, not routed on their snapshots as the live front door does; else null). It prints
one JSON object: requests sent, answers read, and answers read in the window.
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
    until = cfg["until"]
    sending = inject(
        cfg["url"],
        cfg["run"],
        cfg["rate"],
        time.monotonic() + (until - time.time()),
        cfg["reply_to"],
        cfg["prefix"],
        cfg["seed"],
        cfg.get("dcs"),
    )
    sent, (read, read_in_window) = await asyncio.gather(
        sending, answers(cfg["url"], cfg["reply_to"], until, tuple(cfg["window"]))
    )
    return {"sent": sent, "answers_read": read, "answers_in_window": read_in_window}


if __name__ == "__main__":
    print(json.dumps(asyncio.run(main(json.loads(sys.argv[1])))), flush=True)
