"""`bubbletea drain SLOT`: ask one stage worker to leave its run while the run goes on; and
`bubbletea slots`, what a datacenter's batch script needs to know of the run's slots.

The worker finishes the iteration in progress (its step included), hands its queued prefill back,
and gives its slot to a spare or a replacement (`services/stage_worker/membership/leaving.py`); its peers take
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

from bubbletea.cli_common import CONFIG_HELP, CommandError, run_id_argument
from shared.config.settings import load_settings

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
    p.add_argument("--run", type=run_id_argument, help="the run id (default: $BUBBLETEA_RUN)")
    p.add_argument("--config", help=CONFIG_HELP)
    p.add_argument(
        "--timeout", type=float, default=WAIT_S, help=f"seconds to wait for it to leave (default {WAIT_S:g})"
    )
    p.add_argument("--no-wait", action="store_true", help="ask, and return at once")
    p.set_defaults(func=drain)

    p = sub.add_parser(
        "slots",
        help="a datacenter's slots of the run: how many, whether the run recovers, how many were left",
        description="The slots the spec places in datacenter DC (its stages x DP), whether the run recovers a lost "
        "worker (training.checkpoint_every > 0: only then is a spare of use), and with --live, read from Redis "
        "(REDIS_URL, BUBBLETEA_RUN or --run), how many of them a worker left on purpose (a drain) and nobody holds "
        "yet, finished training, and were stopped with the run. --shell prints SLOTS=.. RECOVERS=.. and with --live "
        "LEFT=.. DONE=.. STOPPED=.. for a batch script to eval (deploy/slurm/workers.sbatch does).",
    )
    p.add_argument("--dc", help="the datacenter (default: $BUBBLETEA_DC)")
    p.add_argument("--run", type=run_id_argument, help="the run id, with --live (default: $BUBBLETEA_RUN)")
    p.add_argument("--config", help=CONFIG_HELP)
    p.add_argument(
        "--live", action="store_true", help="also count the slots left (drained) and not taken again, done, stopped"
    )
    p.add_argument("--shell", action="store_true", help="print NAME=value lines for eval")
    p.set_defaults(func=slots)


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
    from shared.bus.connection import client_for
    from shared.control.leases import slot_end
    from shared.wire import keys
    from shared.wire.status import LeaseState

    r = client_for(url, socket_timeout=10)
    try:
        holder = await r.get(keys.lease_key(run, replica, stage))
        if holder is None:
            state, reason = await slot_end(r, run, replica, stage)
            if state is not None:  # finished training, stopped, or left: say which
                raise CommandError(f"slot {slot} of run {run!r} has ended ({reason or state.value}): nothing to drain")
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


def slots(args: argparse.Namespace) -> int:
    import json

    from shared.policies.pipeline_plan import placement_of

    settings = load_settings(args.config)
    spec = settings.spec
    dc = args.dc or settings.dc
    names = [d.name for d in spec.datacenters]
    if dc not in names:
        raise CommandError(f"--dc: the spec's datacenters are {', '.join(names)}, got {dc!r} (or set BUBBLETEA_DC)")
    stages = [k for k, home in enumerate(placement_of(spec).stage_dc) if home == dc]
    mine = {f"r{d}s{k}" for k in stages for d in range(spec.parallelism.dp)}
    out: dict[str, object] = {"dc": dc, "slots": len(mine), "recovers": int(spec.training.recovers)}
    if args.live:
        out.update(asyncio.run(_live(settings.require_redis_url(), args.run or settings.run, spec, mine)))
    if args.shell:
        print("\n".join(f"{k.upper()}={v}" for k, v in out.items() if k != "dc"))
    else:
        print(json.dumps(out))
    return 0


async def _live(url: str, run: str, spec: Any, mine: set[str]) -> dict[str, int]:
    """How many of `mine` a worker left on purpose and nobody holds yet, finished training, and
    were stopped with the run. A batch script tells a drained worker's exit 0 from a finished one's
    by `done`, not by `left`: a waiting spare may have taken the slot before the script asks."""
    from shared.bus.connection import client_for
    from shared.control.leases import read_slots
    from shared.wire.status import LeaseState

    r = client_for(url, socket_timeout=10)
    try:
        views = [v for v in await read_slots(r, run, spec.parallelism.pp, spec.parallelism.dp) if v.name in mine]
    finally:
        await r.aclose()
    return {
        "left": sum(v.ended is LeaseState.LEFT and not v.held for v in views),
        "done": sum(v.ended is LeaseState.DONE for v in views),
        "stopped": sum(v.ended is LeaseState.STOPPED for v in views),
    }
