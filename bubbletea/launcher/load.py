"""The load generator as a user runs it: its own process, started once a training run has bubbles.

Shared by `bubbletea demo` and `bench/bubble_fill.py`. It is niced like the front door: on a machine
where everything shares a few cores, the guests yield the CPU to training (the owner).
"""

from __future__ import annotations

import asyncio
import functools
import json
import sys
from pathlib import Path
from typing import Any

from bubbletea.launcher.procs import child_setup
from shared import keys
from shared.bus import Bus
from shared.config import BusConfig

#: Niceness of the load generator (as the front door's, `PREFILL_QUEUE.nice`).
LOAD_NICE = 10
#: How long to wait for a training run's first bubble before giving up.
FIRST_BUBBLE_TIMEOUT_MS = 120_000
#: And then for the API to say it serves.
READY_TIMEOUT_S = 30


async def run_loadgen(redis_url: str, run: str, args: list[str], json_out: Path) -> dict[str, Any]:
    """Wait for `run`'s first bubble, run ``python -m loadgen ARGS --json-out JSON_OUT --disable-tqdm``
    and return its JSON summary (`RuntimeError` if it fails). The load generator itself then waits
    for the front door's /ready (the dispatcher's verdict reaches it a moment after the bubble)."""
    async with Bus(redis_url, BusConfig(), name="loadgen-launcher") as bus:
        await bus.redis.xread({keys.bubbles_stream(run): "0"}, count=1, block=FIRST_BUBBLE_TIMEOUT_MS)
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "loadgen",
        *args,
        "--ready-check-timeout-sec",
        str(READY_TIMEOUT_S),
        "--disable-tqdm",
        "--json-out",
        str(json_out),
        stdout=asyncio.subprocess.DEVNULL,
        preexec_fn=functools.partial(child_setup, LOAD_NICE),
    )
    if await proc.wait() != 0:
        raise RuntimeError(f"the load generator exited with code {proc.returncode}")
    result: dict[str, Any] = json.loads(await asyncio.to_thread(json_out.read_text))
    return result
