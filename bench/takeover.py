"""A spare's takeover: from a killed stage worker to its slot taken and the run training again
(issue 49, "spares that are ready").

`bubbletea up` restarts a dead worker itself and frees its slot at once (it saw the process die);
compose, Slurm and Kubernetes instead keep a spare worker per datacenter, which learns of the death
from Redis alone. This bench runs that: a private redis-server, the WAN broker, the spec's PP x DP
stage workers and one spare, as separate processes as those deployments start them, training until
stopped. It SIGKILLs a slot holder (a seeded draw) `--kills` times, `--every` s after the run trains
again; after each takeover it starts a new spare, as a Slurm job or a compose restart would, and
waits for it to be ready. Two arms in one invocation, the same in all but one setting:

* **liveness** (`BUBBLETEA_LEASE_LIVENESS=on`, the default): the spare takes the slot once Redis has
  seen the dead worker's connections close and it missed a renewal (`shared.policies.lease_liveness`);
* **expiry** (`off`): once the dead worker's lease expired (`LEASE_TTL_MS`), as before.

Figures per arm (host wall clock, seconds, over every kill): kill to the slot leased by the spare
(its log), and kill to training again (every slot joined a later generation: `churn_figures`), p50,
p99 and max; kills survived (training again within `--timeout`). Side by side: liveness's p50s over
expiry's. One JSON line last.

    python bench/takeover.py              # 8 kills an arm
    python bench/takeover.py --quick      # 3 kills an arm
"""

from __future__ import annotations

import argparse
import asyncio
import io
import json
import random
import re
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


from bench.lib import churn_figures as figs  # noqa: E402
from bench.lib.arms import arms_of  # noqa: E402
from bubbletea.launcher.procs import Proc, spawn, stop_all  # noqa: E402
from bubbletea.launcher.services import STAGE_WORKER, WAN_BROKER  # noqa: E402
from shared.bus.connection import client_for  # noqa: E402
from shared.config.spec import load_spec  # noqa: E402
from shared.figures.percentiles import percentile  # noqa: E402
from shared.policies.lease_liveness import SETTLE_S  # noqa: E402
from shared.runtime.redis_server import EmbeddedRedis  # noqa: E402
from shared.wire import keys  # noqa: E402

DEFAULT_CONFIG = ROOT / "configs" / "demo.yaml"
ARMS = {"liveness": "on", "expiry": "off"}
LEASED = re.compile(r"^ts=(\S+) .*msg=\"?slot leased by a spare\"?")


def leased_at(log: Path) -> float | None:
    """When the spare whose log this is leased a slot (wall clock), if it did."""
    for line in log.read_text(errors="replace").splitlines():
        if m := LEASED.search(line):
            return figs.log_time(m.group(1))
    return None


async def wait_for(check: Any, timeout_s: float, poll_s: float = 0.05) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if await check():
            return True
        await asyncio.sleep(poll_s)
    return False


async def arm(name: str, args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    spec = load_spec(args.config)
    slots = spec.parallelism.pp * spec.parallelism.dp
    redis = EmbeddedRedis().start()
    run = f"takeover-{name}-{uuid.uuid4().hex[:6]}"
    logs = workdir / name
    logs.mkdir(parents=True)
    env = {
        "REDIS_URL": redis.url,
        "BUBBLETEA_CONFIG": str(args.config),
        "BUBBLETEA_RUN": run,
        "BUBBLETEA_ITERATIONS": "until_stopped",
        "BUBBLETEA_TIME_SCALE": str(args.time_scale),
        "BUBBLETEA_STATE_DIR": str(workdir / "state"),
        "BUBBLETEA_LEASE_LIVENESS": ARMS[name],
        "BUBBLETEA_METRICS_PORT": "off",
    }
    r = client_for(redis.url, socket_timeout=None)
    procs: list[Proc] = []
    count = 0

    async def start(svc: Any) -> tuple[Proc, Path]:
        nonlocal count
        count += 1
        path = logs / f"{svc.name}-{count}.log"
        p = await spawn(svc, env, out=io.StringIO(), quiet=True, log_file=path)
        procs.append(p)
        return p, path

    async def generation() -> int:
        return int(await r.get(keys.generation_key(run)) or 0)

    async def trains_after(gen: int) -> bool:
        """Every slot said it joined a generation after `gen` (its state restored: training again)."""
        joined = await asyncio.to_thread(figs.joins, sorted(logs.glob("stage_worker-*.log")))
        return any(g > gen and len(at) >= slots for g, at in joined.items())

    rng = random.Random(args.seed)
    kills: list[dict[str, Any]] = []
    try:
        await start(WAN_BROKER)
        for _ in range(slots):
            await start(STAGE_WORKER)
        if not await wait_for(lambda: trains_after(0), args.timeout):
            raise RuntimeError(f"{name}: the run never trained (logs in {logs})")
        for i in range(args.kills):
            spare, spare_log = await start(STAGE_WORKER)

            async def spare_ready(spare: Proc = spare) -> bool:  # it logs nothing more until it takes a slot
                return any("spare ready" in line for line in spare.tail)

            if not await wait_for(spare_ready, args.timeout, 0.2):
                raise RuntimeError(f"{name}: the spare of kill {i} never got ready (logs in {logs})")
            await asyncio.sleep(args.every + rng.random())  # jittered by a renewal interval: any phase
            while float((await r.info("server"))["uptime_in_seconds"]) < SETTLE_S:  # noqa: ASYNC110
                await asyncio.sleep(0.5)
            d, k = rng.randrange(spec.parallelism.dp), rng.randrange(spec.parallelism.pp)
            held: Any = await r.get(keys.lease_key(run, d, k))
            holder = (held or b"").decode()
            victim = next(p for p in procs if holder.endswith(f"-{p.proc.pid}") and p.proc.returncode is None)
            gen = await generation()
            killed = time.time()
            victim.proc.kill()
            left_ms = await r.pttl(keys.lease_key(run, d, k))
            survived = await wait_for(lambda gen=gen: trains_after(gen), args.timeout)
            kills.append(
                {
                    "at": killed,
                    "generation": gen,
                    "spare_log": spare_log,
                    "survived": survived,
                    "lease_left_ms": left_ms,
                }
            )
            print(f"{name}: kill {i + 1}/{args.kills} of r{d}s{k}: survived={survived}", file=sys.stderr, flush=True)
            await victim.proc.wait()
    finally:
        await stop_all(procs)
        await r.aclose()
        redis.stop()
    joined = figs.joins(sorted(logs.glob("stage_worker-*.log")))
    return figures(kills, joined, slots)


def figures(kills: list[dict[str, Any]], joined: dict[int, list[float]], slots: int) -> dict[str, Any]:
    """Per kill: to the slot leased (the spare's log) and to training again; their spread."""
    taken, back = [], []
    for kill in kills:
        at = leased_at(kill["spare_log"])
        if at is not None:
            taken.append(max(0.0, at - kill["at"]))
        back.append(figs.recovered_in(figs.back_after(kill["at"], kill["generation"], joined, slots)))
    out: dict[str, Any] = {
        "kills": len(kills),
        "survived": sum(k["survived"] for k in kills),
        "lease_left_at_kill_p50_s": figs.rounded(figs.median([k["lease_left_ms"] / 1000 for k in kills])),
    }
    for label, values in (("taken", taken), ("back", back)):
        for p in (50, 99):
            out[f"{label}_p{p}_s"] = figs.rounded(percentile(values, p))
        out[f"{label}_max_s"] = figs.rounded(max(values, default=None))
    return out


def side_by_side(results: dict[str, dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    live, exp = results.get("liveness", {}), results.get("expiry", {})
    for label in ("taken", "back"):
        a, b = live.get(f"{label}_p50_s"), exp.get(f"{label}_p50_s")
        finite = isinstance(a, float | int) and isinstance(b, float | int) and a and b  # not "inf"
        out[f"{label}_p50_liveness_over_expiry"] = round(a / b, 3) if finite else None
    return out


async def bench(args: argparse.Namespace) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="bt-takeover-") as tmp:
        workdir = args.logs or Path(tmp)
        results = {name: await arm(name, args, workdir) for name in args.arms}
    return {
        "bench": "takeover",
        "clock": "host wall",
        "time_scale_k": args.time_scale,
        "kills_per_arm": args.kills,
        "every_s": args.every,
        **{f"{name}": res for name, res in results.items()},
        **side_by_side(results),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--kills", type=int, default=8, help="stage workers killed an arm (default 8)")
    p.add_argument("--quick", action="store_true", help="3 kills an arm")
    p.add_argument("--every", type=float, default=10.0, help="seconds of training between kills (default 10)")
    p.add_argument("--arms", default=",".join(ARMS), help=f"which arms, in order (default {','.join(ARMS)})")
    p.add_argument("--time-scale", type=float, default=4.0, help="the device time scale k (default 4)")
    p.add_argument("--config", type=Path, default=DEFAULT_CONFIG, help="the spec (default: the demo's)")
    p.add_argument("--seed", type=int, default=0, help="which slots are killed")
    p.add_argument("--logs", type=Path, help="keep every process's log under this directory (default: deleted)")
    p.add_argument("--timeout", type=float, default=120.0, help="seconds a start or a takeover may take")
    args = p.parse_args(argv)
    if args.quick:
        args.kills = 3
    args.arms = arms_of(p, args.arms, ARMS)
    if args.kills < 1 or args.every < 0 or args.time_scale < 1:
        p.error("--kills must be at least 1, --every at least 0, --time-scale at least 1")
    print(json.dumps(asyncio.run(bench(args))))
    return 0


if __name__ == "__main__":
    sys.exit(main())
