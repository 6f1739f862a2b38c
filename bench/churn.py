"""Goodput under churn: training and serving go on while workers keep dying (issue 49).

Three arms, one after another, each a fresh `bubbletea up` (its default spec unless `--config`) on a
private redis-server (append-only file), every arm at the same device time scale (measured once
here, or `--time-scale`) and under the same open-loop load: Poisson arrivals at `--load` (default
0.8) of the bubbles' capacity (the simulator's, for this spec and scale), sent by the load generator
over real HTTP with a TTFT objective (`--ttft-slo-ms`), for `--duration` seconds:

* **calm**: no faults;
* **churn**: stage workers SIGKILLed at Poisson arrivals, one every `--mtbf` s on average across the
  job (or every `--every` s exactly), and the control plane's services (dispatcher, front door,
  Redis, in turn) at `--control-mtbf` (0: none); `up` restarts what dies, and a lost worker's
  replacement takes its stage's state from a live peer (docs/architecture.md, "A lost worker").
  With `--drain` the workers get SIGTERM instead, as from an orchestrator evicting their pods: each
  leaves at its next step boundary and `up` starts its replacement;
* **restart**: whole-job checkpoint-restart, the baseline: at each of the same faults everything
  stops (`up` told to stop) and starts again, training resuming from the newest checkpoint.

Figures (one JSON line last; every fault and every request sent counts):

* per arm: `faults`, `survived` (the run trained again after it; a control service: `up` restarted
  it healthy, Redis: an iteration ended and a request was answered after its restart), kill to
  training again p50 / p99 / max (s, wall clock, over the worker faults and every fault of the
  restart arm; a fault never recovered counts, as infinite: "inf"), `control_back_max_s` (a control
  service's kill to `up` saying it is healthy again, Redis's to serving again),
  `useful_iterations` (iterations every stage of some replica stepped, each counted once:
  `churn_figures`) and `useful_per_hour`,
  `redone_iterations`, `losses_equal` (every replica's loss against single-process training of the
  spec the run trained), `slo_attainment` of the requests sent, `requests_lost` (no answer within
  the load generator's timeout);
* side by side: `goodput_vs_calm` (churn's useful iterations per hour over calm's),
  `restart_goodput_vs_calm`, `slo_vs_calm` (churn's attainment over calm's).

It writes a picture (useful iterations and SLO attainment over time, each fault marked) into
`--out`.

    python bench/churn.py                 # 10 minutes an arm, a worker lost every 30 s on average
    python bench/churn.py --quick         # 2 minutes an arm
    python bench/churn.py --every 20      # a worker lost every 20 s exactly
    python bench/churn.py --arms calm,churn
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import re
import signal
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import chaos  # noqa: E402

from bench.lib import churn_figures as figs  # noqa: E402
from bench.lib.arms import arms_of  # noqa: E402
from bubbletea.launcher.load import run_loadgen  # noqa: E402
from shared.bus.connection import TRANSIENT_ERRORS as REDIS_ERRORS  # noqa: E402
from shared.bus.connection import client_for, sync_client_for  # noqa: E402
from shared.config.spec import load_spec  # noqa: E402
from shared.figures.percentiles import percentile  # noqa: E402
from shared.runtime.redis_server import EmbeddedRedis, free_port  # noqa: E402
from shared.wire import keys  # noqa: E402

ARMS = ("calm", "churn", "restart")
DEFAULT_CONFIG = ROOT / "configs" / "demo.yaml"
#: The load's prompts (the demo's): 96 tokens on average, uniform within +-33%.
INPUT_LEN, RANGE_RATIO = 96, 0.33
#: A request the load generator has no answer to after this long is lost.
REQUEST_TIMEOUT_S = 120
#: How long `up` may take to come up (it measures nothing when the time scale is given).
UP_TIMEOUT_S = 240
#: How long a killed Redis stays down before it is started again on its files.
REDIS_DOWN_S = 2.0


class Arm:
    """One arm: its Redis, its `up` (started again by the restart arm), its faults."""

    def __init__(self, name: str, args: argparse.Namespace, k: float, rate: float, folder: Path) -> None:
        self.name, self.args, self.k, self.rate, self.folder = name, args, k, rate, folder
        self.run = f"churn-{name}-{uuid.uuid4().hex[:6]}"
        self.port = free_port()
        self.api = f"http://127.0.0.1:{self.port}"
        self.redis_dir = folder / "redis"
        self.redis_dir.mkdir(parents=True, exist_ok=True)
        self.redis = EmbeddedRedis(persist=True, data_dir=str(self.redis_dir)).start()
        self.up: chaos.Up | None = None
        self.faults: list[dict[str, Any]] = []
        self.lines: list[str] = []
        self.watching: set[asyncio.Task[None]] = set()  # control services being waited for

    def env(self) -> dict[str, str]:
        env = {**os.environ, "REDIS_URL": self.redis.url, "BUBBLETEA_HTTP_PORT": str(self.port)}
        env |= {"BUBBLETEA_RUN": self.run, "BUBBLETEA_TIME_SCALE": f"{self.k:g}"}
        env.pop("BUBBLETEA_API_KEY", None)
        return env

    async def start_up(self) -> None:
        cmd = (sys.executable, "-m", "bubbletea.cli", "up", "--config", str(self.args.config))
        proc = await asyncio.create_subprocess_exec(
            *cmd,
            "--run",
            self.run,
            "--out",
            str(self.folder),
            env=self.env(),
            cwd=ROOT,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT,
        )
        self.up = chaos.Up(proc)
        await self.up.wait_for(r"Ctrl-C stops everything", UP_TIMEOUT_S)

    async def stop_up(self) -> None:
        if self.up is None:
            return
        if self.up.proc.returncode is None:
            await chaos.stop_up(self.up.proc)
        await asyncio.gather(self.up.reader, return_exceptions=True)
        self.lines += self.up.lines

    def generation(self) -> int:
        r = sync_client_for(self.redis.url, protocol=None, socket_timeout=5)
        try:
            return int(r.get(keys.generation_key(self.run)) or 0)
        finally:
            r.close()

    async def inject(self, fault: figs.Fault, rng: random.Random) -> None:
        """The fault, as this arm suffers it: the churn arm loses one service (up restarts it), the
        restart arm stops and starts the whole job."""
        assert self.up is not None
        at, gen = time.time(), await asyncio.to_thread(self.generation)
        what = fault.kind
        record: dict[str, Any] = {"at": at, "offset_s": fault.at_s, "kind": fault.kind, "generation": gen}
        if self.name == "restart":
            await self.stop_up()
            await self.start_up()
        elif fault.kind == "worker":
            what = rng.choice(sorted(label for label in self.up.pids if label.startswith("stage_worker-")))
            # --drain: SIGTERM, as an orchestrator evicting its pod (it leaves at a step boundary)
            os.kill(self.up.pids[what], signal.SIGTERM if self.args.drain else signal.SIGKILL)
        elif fault.kind == "redis":
            self.redis.kill()  # SIGKILL: the append-only file is all that survives
            await asyncio.sleep(REDIS_DOWN_S)
            self.redis = EmbeddedRedis(port=self.redis.port, persist=True, data_dir=str(self.redis_dir)).start()
            self.watching.add(asyncio.create_task(self._redis_back(record, time.time())))
        else:
            since = len(self.up.lines)
            os.kill(self.up.pids[fault.kind], signal.SIGKILL)
            self.watching.add(asyncio.create_task(self._back(record, fault.kind, since)))
        record["killed"] = what
        self.faults.append(record)  # (a control service's `back_at` comes later, into this record)
        print(json.dumps({"arm": self.name, **record}), file=sys.stderr, flush=True)

    async def _redis_back(self, record: dict[str, Any], restarted: float, within_s: float = 120.0) -> None:
        """Redis is back for the run once, after its restart at `restarted`, an iteration has ended
        and a request has been answered (entries of the events and results streams, whose ids are
        their times); not once it was started again (issue 62: stamped after the 2 s sleep, every
        Redis fault counted survived). Not within `within_s`: never back (infinite in the figures)."""
        after = f"{int(restarted * 1000)}-0"
        r = client_for(self.redis.url, socket_timeout=5)
        deadline = time.monotonic() + within_s
        try:
            while time.monotonic() < deadline:
                with contextlib.suppress(OSError, *REDIS_ERRORS):
                    trained = await r.xrange(keys.events_stream(self.run), min=after, count=1)
                    results = await r.keys(keys.prefill_results_stream(self.run, "*"))
                    answered = [await r.xrange(k, min=after, count=1) for k in results]
                    if trained and any(answered):
                        record["back_at"] = time.time()
                        return
                await asyncio.sleep(0.2)  # two streams' newest entries: nothing one read blocks on
        finally:
            await r.aclose()

    async def _back(self, record: dict[str, Any], label: str, since: int) -> None:
        """When `up` says the killed control service is restarted and healthy."""
        assert self.up is not None
        with contextlib.suppress(SystemExit):  # not within the time: not back
            await self.up.wait_for(rf"==> {re.escape(label)} restarted \(pid \d+\): healthy", 120, since)
            record["back_at"] = time.time()

    async def go(self, faults: list[figs.Fault]) -> dict[str, Any]:
        args = self.args
        await self.start_up()
        start = time.time()
        load_args = ["--base-url", self.api, "--request-rate", f"{self.rate:.4f}", "--duration", str(args.duration)]
        load_args += ["--input-len", str(INPUT_LEN), "--range-ratio", str(RANGE_RATIO), "--seed", str(args.seed)]
        load_args += ["--timeout", str(REQUEST_TIMEOUT_S), "--goodput", f"ttft:{args.ttft_slo_ms * self.k:g}"]
        load = asyncio.create_task(run_loadgen(load_args, self.folder / "loadgen.json"))
        rng = random.Random(args.seed)
        try:
            for fault in faults if self.name != "calm" else []:
                await asyncio.sleep(max(0.0, start + fault.at_s - time.time()))
                await self.inject(fault, rng)
            served = await load
            await asyncio.gather(*self.watching, return_exceptions=True)
        finally:
            end = time.time()
            await self.stop_up()
        return await asyncio.to_thread(self.figures, served, start, end)

    def figures(self, load: dict[str, Any], start: float, end: float) -> dict[str, Any]:
        spec = load_spec(self.folder / self.run / "spec.yaml")  # what up gave its services
        slots = spec.parallelism.pp * spec.parallelism.dp
        done = chaos.iterations_done(self.redis.url, self.run)
        trained = figs.training(done, spec.parallelism.pp, start, end)
        losses = chaos.training_figures(done, spec)
        joined = figs.joins(sorted((self.folder / self.run / "logs").glob("stage_worker-*.log")))
        by_generation = [f for f in self.faults if f["kind"] == "worker" or self.name == "restart"]
        back = [figs.back_after(f["at"], f["generation"], joined, slots) for f in by_generation]
        backs = [figs.recovered_in(b) for b in back]  # one never back counts, as infinite
        # the control plane's services: back once up said so (Redis: once an iteration ended and a
        # request was answered after its restart); one never back counts, as infinite
        control_faults = [f for f in self.faults if f not in by_generation]
        control = [figs.recovered_in(f["back_at"] - f["at"] if "back_at" in f else None) for f in control_faults]
        slo_ms = self.args.ttft_slo_ms * self.k
        served = figs.serving(load, slo_ms)
        hours = (end - start) / 3600
        return {
            "arm": self.name,
            "run": self.run,
            "seconds": round(end - start, 1),
            "faults": len(self.faults),
            "faults_by_kind": {k: sum(f["kind"] == k for f in self.faults) for k in {f["kind"] for f in self.faults}},
            "survived": sum(b is not None for b in back) + sum("back_at" in f for f in control_faults),
            "back_p50_s": figs.rounded(figs.median(backs)),
            "back_p99_s": figs.rounded(percentile(backs, 99)),
            "back_max_s": figs.rounded(max(backs, default=None)),
            "control_back_max_s": figs.rounded(max(control, default=None)),
            "useful_iterations": trained["useful_iterations"],
            "useful_per_hour": round(trained["useful_iterations"] / hours, 1) if hours > 0 else None,
            "redone_iterations": len(trained["redone_iterations"]),
            "losses_equal": losses["losses_equal"],
            "iterations_checked": losses["iterations_checked"],
            "requests_sent": served["requests_sent"],
            "requests_answered": served["requests_answered"],
            "slo_attainment": served["slo_attainment"],
            "requests_lost": served["errors"].get("timeout", 0),
            "errors": served["errors"],
            # for the picture, not the JSON line
            "_series": {"start": start, "end": end, "completed_at": trained["completed_at"], "faults": self.faults}
            | {"send_times": served["send_times"], "good": served["good"]},
        }

    def close(self) -> None:
        self.redis.stop()
        (self.folder / "up.out").write_text("\n".join(self.lines) + "\n")


def capacity_rate(config: Path, k: float) -> float:
    """Requests per real second the bubbles of `config` hold at time scale `k` (the simulator's
    capacity for the load's mean prompt)."""
    from shared.config.timescale import scale_spec
    from sim.run import SimOptions, capacity_rate, run_off
    from sim.setup import build

    spec = scale_spec(load_spec(config), k)
    setup = build(spec)
    off = run_off(setup, 8)
    return capacity_rate(setup, off, SimOptions(input_len=INPUT_LEN))


def time_scale(arg: str, config: Path) -> float:
    if arg != "auto":
        return float(arg)
    from shared.model.calibration import calibrate

    cal = calibrate(load_spec(config))
    print(cal.line(), file=sys.stderr, flush=True)
    return cal.scale


async def bench(args: argparse.Namespace) -> dict[str, Any]:
    k = await asyncio.to_thread(time_scale, args.time_scale, args.config)
    rate = args.load * await asyncio.to_thread(capacity_rate, args.config, k)
    faults = figs.schedule(
        args.duration, mtbf_s=args.mtbf, every_s=args.every, control_mtbf_s=args.control_mtbf, seed=args.seed
    )
    out = Path(tempfile.mkdtemp(prefix="bubbletea-churn-"))
    print(
        f"churn: k = {k:g}, {rate:.2f} requests/s ({args.load:.0%} of capacity), {len(faults)} faults an arm; {out}",
        file=sys.stderr,
        flush=True,
    )
    results: dict[str, dict[str, Any]] = {}
    for name in args.arms:
        arm = Arm(name, args, k, rate, out / name)
        try:
            results[name] = await arm.go(faults)
        finally:
            arm.close()
        print(json.dumps({k: v for k, v in results[name].items() if not k.startswith("_")}), file=sys.stderr)
    series = {name: r.pop("_series") for name, r in results.items()}
    picture = Path(args.out) / f"churn-{time.strftime('%Y%m%d-%H%M%S')}.png"
    picture.parent.mkdir(parents=True, exist_ok=True)
    await asyncio.to_thread(figs.picture, series, picture, args.ttft_slo_ms, k)
    head = {"bench": "churn", "time_scale_k": k, "duration_s": args.duration, "rate_rps": round(rate, 3)}
    head |= {"mtbf_s": args.mtbf, "every_s": args.every, "control_mtbf_s": args.control_mtbf, "drain": args.drain}
    head |= {"ttft_slo_ms": args.ttft_slo_ms, "faults_scheduled": len(faults)}
    return head | side_by_side(results) | {"arms": results, "picture": str(picture), "folder": str(out)}


def side_by_side(results: dict[str, dict[str, Any]]) -> dict[str, Any]:
    def ratio(arm: str, key: str) -> float | None:
        calm, other = results.get("calm", {}).get(key), results.get(arm, {}).get(key)
        return round(other / calm, 3) if calm and other is not None else None

    return {
        "goodput_vs_calm": ratio("churn", "useful_per_hour"),
        "restart_goodput_vs_calm": ratio("restart", "useful_per_hour"),
        "slo_vs_calm": ratio("churn", "slo_attainment"),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--duration", type=float, default=600.0, help="seconds of load an arm (default 600)")
    p.add_argument("--quick", action="store_true", help="120 s an arm")
    p.add_argument("--mtbf", type=float, default=30.0, help="mean seconds between stage-worker kills (default 30)")
    p.add_argument("--every", type=float, help="kill a stage worker every this many seconds exactly instead")
    p.add_argument(
        "--control-mtbf",
        type=float,
        default=0.0,
        help="mean seconds between kills of the dispatcher, the front door and Redis, in turn (default 0: none)",
    )
    p.add_argument("--drain", action="store_true", help="SIGTERM the workers (a drain) instead of SIGKILL")
    p.add_argument("--load", type=float, default=0.8, help="offered load, a share of the bubbles' capacity")
    p.add_argument("--ttft-slo-ms", type=float, default=1000.0, help="the TTFT objective, device ms (default 1000)")
    p.add_argument("--arms", default=",".join(ARMS), help=f"which arms, in order (default {','.join(ARMS)})")
    p.add_argument("--time-scale", default="auto", help="the device time scale k: auto (measured) or a number")
    p.add_argument("--config", type=Path, default=DEFAULT_CONFIG, help="the spec up runs (default: the demo's)")
    p.add_argument("--seed", type=int, default=0, help="the faults' and the load's seed")
    p.add_argument("--out", default="runs", help="where the picture goes (default runs/)")
    args = p.parse_args(argv)
    if args.quick:
        args.duration = 120.0
    args.arms = arms_of(p, args.arms, ARMS)
    if args.duration <= 0 or args.mtbf <= 0 or (args.every is not None and args.every <= 0) or args.control_mtbf < 0:
        p.error("--duration, --mtbf and --every must be above 0, --control-mtbf at least 0")
    result = asyncio.run(bench(args))
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
