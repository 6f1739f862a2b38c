"""The load generator as a user runs it: its own process, started with the training run.

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

#: Niceness of the load generator (as the front door's, `PREFILL_QUEUE.nice`).
LOAD_NICE = 10
#: How long the load generator waits for the API to say it serves: a training run's workers start
#: and join the run within this (the dispatcher's verdict then opens the service).
READY_TIMEOUT_S = 150


async def run_loadgen(args: list[str], json_out: Path) -> dict[str, Any]:
    """Run ``python -m loadgen ARGS --json-out JSON_OUT --disable-tqdm`` and return its JSON summary
    (`RuntimeError` if it fails). Started with the training run, not after its first bubble: the
    process is up and polling /ready while the workers start, so its first requests are queued
    within a poll of the service opening, not after a process start (a second here) that the
    run's first bubbles spent empty."""
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
