"""The fault matrix (issue 62): the faults a deployment meets, each injected `--faults` times into a
live run under load, and what the run did about each.

Every arm is a fresh `bubbletea up` (the demo's spec unless `--config`, PP x DP workers) on a private
redis-server with an append-only file (with `--redis-cluster`: an embedded Redis Cluster of 3
masters and 3 replicas, `REDIS_URL=redis+cluster://...` for every service, as `bench/failover.py`
runs; the arms that restart Redis or reach it from a network namespace are refused there), with
one spare stage worker of our own beside it (started as compose or Slurm start theirs: from Redis
alone it learns of a slot to take), under the open-loop load at `--load` (0.8) of the bubbles'
capacity: Poisson arrivals over real HTTP with a TTFT objective, as `bench/churn.py` sends them.
The arms (`bench/lib/fault_arms.py`):

* `calm`: no fault, the reference every other arm's losses must equal exactly;
* `stall-0.3s`, `stall-1s`: a slot holder SIGSTOPped, then SIGCONT: it must keep its slot and
  nothing may recover; `stall-past-lease`: stopped for the lease's TTL and two renewals: the spare
  takes its slot over, and the stopped worker, let go on, must not train or answer;
* `lost-host`: a slot holder on a network namespace of its own whose packets are all dropped (no FIN):
  taken over within the lease's TTL plus 2 s;
* `duplicate-batch`, `duplicate-answer`: a PrefillBatch, an answer and a prefill report written twice;
* `redis-then-kill`: Redis killed and restarted on its file, a worker killed 3 s after;
* `dispatcher-stall`: the dispatcher stopped past the claim time with a second one beside it;
* `dispatcher-kill`: the leading dispatcher SIGKILLed with a standby beside it: the standby must
  send its first batch within 2 s (`serving_s`; `takeover_s`: to the lease taken), and schedule
  nothing twice; `up` restarts its own (the next standby), a killed one of ours is replaced;
* `cancelled-fill`: a worker killed the moment its neighbour opens a bubble (the neighbour's fill
  is cancelled mid-block).

Figures per arm (one JSON line last; every request sent and every fault counts): requests sent,
answered, lost (no answer within the load generator's timeout), failed by reason, SLO attainment;
requests answered twice (one id twice in the front doors' result streams) and scheduled twice (one
id in two batches: expected after a lost worker's batches move, a defect in a "kept" arm);
iterations trained twice; every loss reported against the calm arm's for the same iteration and
replica, **exactly** (`losses_exact`), and against single-process training of the spec (1e-5);
"kept" arms: faults after which every slot had the same holder and no recovery ran; "recovered"
arms: fault to training again (every slot joined a later generation), p50 / p99 / max, a fault
never recovered counted as infinite ("inf"); the dispatcher kill's `takeover_s` and `serving_s`,
p50 / p99 / max, a kill never taken over or served counted as infinite; `met` says whether the arm
did all it must. Clock: the host's wall clock, seconds.

    python bench/faults.py                       # every arm, 5 faults each
    python bench/faults.py --arms calm,lost-host --faults 3
    python bench/faults.py --redis-cluster --arms calm,dispatcher-kill
"""

from __future__ import annotations

import argparse
import asyncio
import io
import json
import os
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import chaos  # noqa: E402
import churn  # noqa: E402
from redis.asyncio import Redis  # noqa: E402

from bench.lib import churn_figures as figs  # noqa: E402
from bench.lib import fault_arms, lost_host  # noqa: E402
from bench.lib import fault_figures as ff  # noqa: E402
from bench.lib.arms import arms_of  # noqa: E402
from bubbletea.launcher.load import run_loadgen  # noqa: E402
from bubbletea.launcher.procs import Proc, spawn, stop_all  # noqa: E402
from bubbletea.launcher.services import DISPATCHER, STAGE_WORKER  # noqa: E402
from shared.bus.connection import client_for  # noqa: E402
from shared.config.spec import load_spec  # noqa: E402
from shared.runtime.redis_cluster import EmbeddedCluster  # noqa: E402
from shared.runtime.redis_server import EmbeddedRedis, free_port  # noqa: E402
from shared.wire import keys  # noqa: E402

#: What the arms run on (`--redis-cluster`), as the JSON line says it.
REDIS_ONE = "one redis-server, append-only file"
REDIS_CLUSTER = "embedded cluster, 3 masters + 3 replicas"
#: Seconds of load before the first fault, and after the last one's planned time.
WARM_S, TAIL_S = 15.0, 15.0
#: Seconds between faults: a lost host's fault first puts a worker on the host (a spare started,
#: a drain), so it spaces its faults further.
EVERY_S = {"lost-host": 80.0}
DEFAULT_EVERY_S = 20.0


class Run:
    """One arm's run: its Redis, its `up`, the processes we start beside it (`fault_arms.Live`)."""

    def __init__(self, arm: str, args: argparse.Namespace, k: float, folder: Path) -> None:
        import random

        self.arm, self.args, self.k, self.folder = arm, args, k, folder
        self.run = f"faults-{arm}-{uuid.uuid4().hex[:6]}"
        self.port = free_port()
        self.api = f"http://127.0.0.1:{self.port}"
        self.redis_dir = folder / "redis"
        self.redis_dir.mkdir(parents=True, exist_ok=True)
        self.server: EmbeddedRedis | EmbeddedCluster = (
            EmbeddedCluster().start()
            if args.redis_cluster
            else EmbeddedRedis(persist=True, data_dir=str(self.redis_dir)).start()
        )
        self.rng = random.Random(args.seed)
        self.up: chaos.Up | None = None
        self.extras: list[Proc] = []
        self.host: lost_host.LostHost | None = None
        self._r: Redis | None = None
        self.stopped = False
        self.spec = load_spec(args.config)

    @property
    def run_folder(self) -> Path:
        return self.folder / self.run

    @property
    def plane_host(self) -> str:
        return self.host.root_address if self.host else "127.0.0.1"

    def redis(self) -> Redis:
        if self._r is None:
            self._r = client_for(self.server.url, socket_timeout=10)
        return self._r

    async def open_host(self) -> None:
        """The lost host's namespace, and Redis listening on its link too (as the kernel WAN does)."""
        self.host = await asyncio.to_thread(lost_host.LostHost(0, uuid.uuid4().hex[:4]).build)
        await self.redis().config_set("bind", f"127.0.0.1 {self.host.root_address}")
        await self.redis().config_set("protected-mode", "no")  # the link reaches no other machine

    async def start_up(self) -> None:
        env = {**os.environ, "REDIS_URL": self.server.url, "BUBBLETEA_HTTP_PORT": str(self.port)}
        env |= {
            "BUBBLETEA_RUN": self.run,
            "BUBBLETEA_TIME_SCALE": f"{self.k:g}",
            "BUBBLETEA_PLANE_HOST": self.plane_host,
        }
        env.pop("BUBBLETEA_API_KEY", None)
        cmd = (sys.executable, "-m", "bubbletea.cli", "up", "--config", str(self.args.config), "--run", self.run)
        proc = await asyncio.create_subprocess_exec(
            *cmd,
            "--out",
            str(self.folder),
            env=env,
            cwd=ROOT,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT,
        )
        self.up = chaos.Up(proc)
        await self.up.wait_for(r"Ctrl-C stops everything", churn.UP_TIMEOUT_S)
        self.spec = load_spec(self.run_folder / "spec.yaml")  # what up gave its services

    def _env(self, redis_host: str, plane_host: str) -> dict[str, str]:
        return {
            "REDIS_URL": self.server.url.replace("127.0.0.1", redis_host),
            "BUBBLETEA_CONFIG": str(self.run_folder / "spec.yaml"),
            "BUBBLETEA_RUN": self.run,
            "BUBBLETEA_TIME_SCALE": f"{self.k:g}",
            "BUBBLETEA_STATE_DIR": str((self.run_folder / "state").absolute()),
            "BUBBLETEA_METRICS_PORT": "off",
            "BUBBLETEA_PLANE_HOST": plane_host,
        }

    async def start_worker(self, label: str, *, host: Any = None) -> Proc:
        env = self._env(host.root_address, host.address) if host else self._env("127.0.0.1", self.plane_host)
        prefix = host.prefix if host else ()
        log = self.run_folder / "logs" / f"{label}.log"  # beside up's: the joins are read from all
        p = await spawn(STAGE_WORKER, env, out=io.StringIO(), quiet=True, log_file=log, label=label, prefix=prefix)
        self.extras.append(p)
        return p

    async def start_dispatcher(self, label: str = "dispatcher-second") -> Proc:
        env = self._env("127.0.0.1", self.plane_host)
        log = self.run_folder / "logs" / f"{label}.log"
        p = await spawn(DISPATCHER, env, out=io.StringIO(), quiet=True, log_file=log, label=label)
        self.extras.append(p)
        return p

    async def holders(self) -> dict[tuple[int, int], int]:
        slots = [(d, k) for d in range(self.spec.parallelism.dp) for k in range(self.spec.parallelism.pp)]
        held = await self.redis().mget([keys.lease_key(self.run, d, k) for d, k in slots])
        out = {}
        for slot, value in zip(slots, held, strict=True):
            tail = (value or b"").decode().rpartition("-")[2]
            if tail.isdigit():
                out[slot] = int(tail)
        return out

    async def generation(self) -> int:
        return int(await self.redis().get(keys.generation_key(self.run)) or 0)

    async def restart_redis(self, down_s: float) -> None:
        assert isinstance(self.server, EmbeddedRedis)  # the arm is refused on a cluster (`main`)
        self.server.kill()  # SIGKILL: the append-only file is all that survives
        await asyncio.sleep(down_s)
        port, data = self.server.port, str(self.redis_dir)
        self.server = await asyncio.to_thread(EmbeddedRedis(port=port, persist=True, data_dir=data).start)

    def joins(self) -> dict[int, list[float]]:
        return figs.joins(sorted((self.run_folder / "logs").glob("stage_worker-*.log")))

    async def wait_training_after(self, generation: int, timeout_s: float) -> bool:
        slots = self.spec.parallelism.pp * self.spec.parallelism.dp
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if figs.back_after(0.0, generation, await asyncio.to_thread(self.joins), slots) is not None:
                return True
            await asyncio.sleep(0.2)
        return False

    def service_pid(self, label: str) -> int:
        assert self.up is not None
        return self.up.pids[label]

    def log_count(self, label: str, text: str) -> int:
        """How many lines of a stage worker's log (up's or ours) hold `text`."""
        path = self.run_folder / "logs" / f"{label}.log"
        return path.read_text(errors="replace").count(text) if path.exists() else 0

    def label_of(self, pid: int) -> str | None:
        assert self.up is not None
        return next((label for label, p in self.up.pids.items() if p == pid), None)

    async def stop(self) -> None:
        if self.stopped:
            return
        self.stopped = True
        await stop_all(self.extras)
        if self.up is not None:
            if self.up.proc.returncode is None:
                await chaos.stop_up(self.up.proc)
            await asyncio.gather(self.up.reader, return_exceptions=True)
            (self.folder / "up.out").write_text("\n".join(self.up.lines) + "\n")
        if self._r is not None:
            await self._r.aclose()

    def close(self) -> None:
        self.server.stop()
        if self.host is not None:
            self.host.remove()


def every_s(name: str) -> float:
    return EVERY_S.get(name, DEFAULT_EVERY_S)


async def run_arm(name: str, args: argparse.Namespace, k: float, rate: float, folder: Path) -> dict[str, Any]:
    arm = fault_arms.arms(None).get(name)
    every = every_s(name)
    n = 0 if arm is None else args.faults
    # calm runs as long as the longest arm: every arm's iterations have a calm loss to equal
    longest = max(every_s(a) for a in args.arms)
    duration = WARM_S + args.faults * (longest if arm is None else every) + TAIL_S
    live = Run(name, args, k, folder)
    records: list[dict[str, Any]] = []
    try:
        if isinstance(arm, fault_arms.LostHost):
            await live.open_host()
            arm.host = live.host
        await live.start_up()
        if arm is None or arm.spare:
            spare = await live.start_worker("stage_worker-spare")
            await fault_arms.wait(
                lambda: any("spare ready" in ln for ln in spare.tail), 120, "the spare never got ready"
            )
        if arm is not None:
            await arm.setup(live)
        start = time.time()
        load_args = ["--base-url", live.api, "--request-rate", f"{rate:.4f}", "--duration", f"{duration:g}"]
        load_args += ["--input-len", str(churn.INPUT_LEN), "--range-ratio", str(churn.RANGE_RATIO)]
        load_args += ["--seed", str(args.seed), "--timeout", str(churn.REQUEST_TIMEOUT_S)]
        load_args += ["--goodput", f"ttft:{args.ttft_slo_ms * k:g}"]
        load = asyncio.create_task(run_loadgen(load_args, folder / "loadgen.json"))
        for i in range(n):
            assert arm is not None
            await asyncio.sleep(max(0.0, start + WARM_S + i * every - time.time()))
            record = await arm.inject(live, i)
            records.append(record)
            print(json.dumps({"arm": name, "fault": i, **record}), file=sys.stderr, flush=True)
        served = await load
        end = time.time()
        if arm is not None:
            await arm.teardown(live)
        await live.stop()
        return await asyncio.to_thread(ff.figures, live, arm, records, served, start, end)
    finally:
        await live.stop()
        live.close()


async def bench(args: argparse.Namespace) -> dict[str, Any]:
    k = await asyncio.to_thread(churn.time_scale, args.time_scale, args.config)
    rate = args.load * await asyncio.to_thread(churn.capacity_rate, args.config, k)
    out = Path(tempfile.mkdtemp(prefix="bubbletea-faults-"))
    print(f"faults: k = {k:g}, {rate:.2f} requests/s ({args.load:.0%} of capacity); {out}", file=sys.stderr, flush=True)
    results: dict[str, dict[str, Any]] = {}
    calm: dict[tuple[int, int], list[float]] | None = None
    for name in args.arms:
        try:
            res = await run_arm(name, args, k, rate, out / name)
        except Exception as exc:  # an arm that could not run is reported, not dropped: the others go on
            print(f"faults: arm {name} failed: {exc!r}", file=sys.stderr, flush=True)
            results[name] = {"arm": name, "met": False, "why": [f"the arm could not run: {exc}"], "requests_lost": 0}
            continue
        losses = res.pop("_losses")
        if name == "calm":
            calm = losses
        res |= ff.exact(losses, calm)
        if name != "calm":
            res |= ff.verdict(res, args.faults)
        results[name] = res
        print(json.dumps(res), file=sys.stderr, flush=True)
    arms = [r for n, r in results.items() if n != "calm"]
    head = {"bench": "faults", "clock": "host wall", "time_scale_k": k, "rate_rps": round(rate, 3), "load": args.load}
    head["redis"] = REDIS_CLUSTER if args.redis_cluster else REDIS_ONE
    head |= {"faults_per_arm": args.faults, "folder": str(out)}
    head |= {
        "all_met": all(r["met"] for r in arms) if arms else None,
        "lost_total": sum(r["requests_lost"] for r in arms),
    }
    compact = {n: {k2: v for k2, v in r.items() if k2 != "records"} for n, r in results.items()}
    return head | {"arms": compact}


def main(argv: list[str] | None = None) -> int:
    names = ["calm", *fault_arms.arms(None)]
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--arms", default=",".join(names), help=f"which arms, in order (default {','.join(names)})")
    p.add_argument("--faults", type=int, default=5, help="faults injected an arm (default 5)")
    p.add_argument("--load", type=float, default=0.8, help="offered load, a share of the bubbles' capacity")
    p.add_argument("--ttft-slo-ms", type=float, default=1000.0, help="the TTFT objective, device ms (default 1000)")
    p.add_argument("--time-scale", default="auto", help="the device time scale k: auto (measured) or a number")
    p.add_argument("--config", type=Path, default=churn.DEFAULT_CONFIG, help="the spec up runs (default: the demo's)")
    p.add_argument("--seed", type=int, default=0, help="the faults' and the load's seed")
    p.add_argument(
        "--redis-cluster",
        action="store_true",
        help="run each arm on an embedded Redis Cluster (3 masters, 1 replica each) instead of one redis-server",
    )
    args = p.parse_args(argv)
    args.arms = arms_of(p, args.arms, tuple(names))
    if args.faults < 1:
        p.error("--faults must be at least 1")
    if args.redis_cluster and (refused := fault_arms.refused_on_cluster(args.arms)):
        p.error(f"--redis-cluster: {refused}; leave them out of --arms")
    if "lost-host" in args.arms and (why := lost_host.usable()):
        p.error(f"the lost-host arm cannot run here: {why}; leave it out of --arms")
    if "calm" in args.arms and args.arms[0] != "calm":
        p.error("calm must come first: the other arms' losses are compared with it")
    print(json.dumps(asyncio.run(bench(args))))
    return 0


if __name__ == "__main__":
    sys.exit(main())
