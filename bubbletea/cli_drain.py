"""`bubbletea drain SLOT`: ask one stage worker to leave its run while the run goes on.

The worker finishes the iteration in progress (its step included), hands its queued prefill back,
and gives its slot to a spare or a replacement (`services/stage_worker/leaving.py`); its peers take
it from there as from a lost worker, without rewinding (docs/architecture.md, "A lost worker"). A
SIGTERM to the worker's process asks the same (an orchestrator evicting its pod); this command is
for when you have no process to signal: the worker is on another host, or in a container.
"""

from __future__ import annotations

import argparse
import asyncio
import re
import sys
import time
from typing import Any

from bubbletea.cli_common import CONFIG_HELP, CommandError
from shared.spec.settings import load_settings

SLOT = re.compile(r"^r(\d+)s(\d+)$")
#: How long `drain` waits, by default, for the worker to have left.
WAIT_S = 120.0


def add_parser(sub: Any) -> None:
    p = sub.add_parser(
        "drain",
        help="ask one stage worker to leave the run at its next step boundary; the run goes on",
        description="Ask the worker holding SLOT (r<replica>s<stage>, as its logs and /metrics name it) of the run "
        "(BUBBLETEA_RUN, or --run) to leave at its next step boundary: it finishes the iteration in progress, hands "
        "its queued prefill back and gives its slot to a spare or a replacement (bubbletea up starts one); the run "
        "goes on. Waits until the worker has left (exit 0), or --timeout passes (exit 1). Needs REDIS_URL.",
    )
    p.add_argument("slot", metavar="SLOT", help="the slot to drain, e.g. r0s1")
    p.add_argument("--run", help="the run id (default: $BUBBLETEA_RUN)")
    p.add_argument("--config", help=CONFIG_HELP)
    p.add_argument(
        "--timeout", type=float, default=WAIT_S, help=f"seconds to wait for it to leave (default {WAIT_S:g})"
    )
    p.add_argument("--no-wait", action="store_true", help="ask, and return at once")
    p.set_defaults(func=drain)


def drain(args: argparse.Namespace) -> int:
    settings = load_settings(args.config)
    spec, run = settings.spec, args.run or settings.run
    m = SLOT.match(args.slot)
    if m is None:
        raise CommandError(f"SLOT: expected r<replica>s<stage> such as r0s1, got {args.slot!r}")
    replica, stage = int(m.group(1)), int(m.group(2))
    if not (replica < spec.parallelism.dp and stage < spec.parallelism.pp):
        raise CommandError(
            f"SLOT {args.slot}: the spec's run has replicas 0..{spec.parallelism.dp - 1} and stages "
            f"0..{spec.parallelism.pp - 1} (parallelism.dp, parallelism.pp)"
        )
    return asyncio.run(_drain(settings.require_redis_url(), run, replica, stage, args.slot, args))


async def _drain(url: str, run: str, replica: int, stage: int, slot: str, args: argparse.Namespace) -> int:
    from redis.asyncio import Redis

    from shared.control import keys
    from shared.control.leases import slot_end
    from shared.control.status import LeaseState

    r = Redis.from_url(url, socket_timeout=10)
    try:
        holder = await r.get(keys.lease_key(run, replica, stage))
        if holder is None:
            raise CommandError(f"slot {slot} of run {run!r} has no worker now (no lease): nothing to drain")
        await r.set(keys.drain_key(run, slot), "bubbletea drain", ex=keys.LEASE_END_TTL_S)
        print(f"asked the worker of {slot} (run {run}) to leave at its next step boundary", file=sys.stderr)
        if args.no_wait:
            return 0
        deadline = time.monotonic() + args.timeout
        while time.monotonic() < deadline:
            state, reason = await slot_end(r, run, replica, stage)
            now = await r.get(keys.lease_key(run, replica, stage))
            if state in (LeaseState.LEFT, LeaseState.STOPPED, LeaseState.DONE) or (now is not None and now != holder):
                print(reason or f"{slot} left; its slot was taken again", file=sys.stderr)
                return 0
            await asyncio.sleep(0.5)  # the slot's end marker is a key: there is nothing to block on
        print(f"{slot} has not left within {args.timeout:g}s (the request stands)", file=sys.stderr)
        return 1
    finally:
        await r.aclose()
