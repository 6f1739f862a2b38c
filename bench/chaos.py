"""Chaos: kill -9 every service in turn under load, restart Redis; is anything lost? (issue 14, item 7)

Starts a private redis-server with persistence (append-only file, fsync always), runs `bubbletea up`
on it (every service, training until stopped, checkpoints every `training.checkpoint_every`), and
drives a steady load of native prefill requests (`POST /v1/prefill`, each with its own
Idempotency-Key, retried with the same key while the front door is down). Each round kills, with
SIGKILL, the front door, the dispatcher, the WAN broker and one stage worker (a different one each
round), waiting each time for `up` to report it restarted and healthy, then kills Redis itself and
starts it again on the same port and files. Then every accepted request's final status is read.

Figures (the JSON line last):

* `accepted`: requests answered 202; `answered`: of those, done; `failed`: by reason;
  `refused`: not accepted, by HTTP status (a 503 while Redis is down, for instance);
* `lost`: accepted and never answered nor failed (must be 0);
* `duplicated`: client requests given two different ids across retries (must be 0);
* `training_resumed`: the run trained iterations in a later recovery generation after the worker
  kills; `losses_equal`: every iteration's loss each replica reported (the newest generation's)
  equals that replica's in single-process training of the spec the run trained within 1e-5, and so
  do iterations trained twice (an iteration one replica stepped while the other's step never came
  has the first's loss only: the run went on from its state). That spec is the one `up` gave its
  services (the run folder's spec.yaml: training until stopped, its cosine learning rate ending at
  `--decay-iters`, so the rate changes across the worker kills and a resume that lost its place in
  the schedule shows); the reference trains as many iterations as were reported, not a spec
  rewritten to end there (whose cosine would
  decay over them: 0.02-0.06 off by the last, when the run kept `lr`);
* `valid` and `why`: whether the run's training can be trusted (losses checked and equal), and
  why not; `claims` (nothing lost, nothing duplicated, training resumed, `up` stopped cleanly) and
  `claims_met`: every claim, and only for a valid run. The exit status is 0 only then.

    python bench/chaos.py [--rounds 3] [--rate 10] [--gap 10] [--decay-iters 20] [--quick]

Over 300 lines on purpose: one benchmark (the `up` follower, the load, the faults, the figures) a
reader follows top to bottom.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import random
import re
import signal
import sys
import tempfile
import time
import uuid
from collections import Counter
from pathlib import Path
from typing import Any

import aiohttp

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from shared.bus.connection import sync_client_for  # noqa: E402
from shared.config.spec import ClusterSpec, load_spec  # noqa: E402
from shared.model.reference import train_reference_for  # noqa: E402
from shared.runtime.redis_server import EmbeddedRedis, free_port  # noqa: E402
from shared.wire import IterationDone, decode, keys  # noqa: E402

SERVICES = ("prefill_queue", "dispatcher", "wan_broker", "stage_worker-{}")
#: How long a client retries one request (same Idempotency-Key) while the front door is down.
RETRY_FOR_S = 60.0
#: Each request's deadline: long enough to wait out a worker's replacement and a Redis restart.
DEADLINE_MS = 120_000
#: Where the run's cosine learning rate ends (BUBBLETEA_DECAY_ITERS): a quick run's iterations and
#: its worker kill fall in the decay, a full run's go on at the floor.
DECAY_ITERS = 20
#: How long Redis stays down (killed, then started again on the same port and files).
REDIS_DOWN_S = 2.0
#: How far a loss may be from the reference's (float summation order differs across stages).
LOSS_TOLERANCE = 1e-5


class Up:
    """`bubbletea up` as a child, its output followed: the newest pid of each service label."""

    def __init__(self, proc: asyncio.subprocess.Process) -> None:
        self.proc, self.lines, self.pids = proc, list[str](), dict[str, int]()
        self.changed = asyncio.Event()
        self.reader = asyncio.create_task(self._read())

    async def _read(self) -> None:
        assert self.proc.stdout is not None
        async for raw in self.proc.stdout:
            line = raw.decode(errors="replace").rstrip()
            self.lines.append(line)
            if m := re.search(r"==> started (\S+) \(pid (\d+)\)", line):
                self.pids[m.group(1)] = int(m.group(2))
            self.changed.set()

    async def wait_for(self, pattern: str, timeout: float, since: int = 0) -> re.Match[str]:
        deadline = time.monotonic() + timeout
        while True:
            for line in self.lines[since:]:
                if m := re.search(pattern, line):
                    return m
            if self.proc.returncode is not None:
                raise SystemExit("bubbletea up exited:\n" + "\n".join(self.lines[-30:]))
            self.changed.clear()
            try:
                await asyncio.wait_for(self.changed.wait(), max(0.0, deadline - time.monotonic()))
            except TimeoutError:
                raise SystemExit(f"not within {timeout:.0f}s: {pattern}\n" + "\n".join(self.lines[-30:])) from None


class Load:
    """A steady stream of prefill requests; what became of each one."""

    def __init__(self, api: str, rate: float, seed: int = 0) -> None:
        self.api, self.rate, self.rng = api, rate, random.Random(seed)
        self.ids: dict[str, str] = {}  # idempotency key -> request id
        self.duplicated = 0
        self.refused: Counter[int] = Counter()
        self.retries = 0
        self.stop = asyncio.Event()
        self.tasks: set[asyncio.Task[None]] = set()

    async def run(self, http: aiohttp.ClientSession) -> None:
        while not self.stop.is_set():
            task = asyncio.create_task(self._one(http))
            self.tasks.add(task)
            task.add_done_callback(self.tasks.discard)
            await asyncio.sleep(self.rng.expovariate(self.rate))  # Poisson arrivals
        await asyncio.gather(*self.tasks, return_exceptions=True)

    async def _one(self, http: aiohttp.ClientSession) -> None:
        key = uuid.uuid4().hex
        prompt = [self.rng.randrange(256) for _ in range(self.rng.randint(8, 128))]
        body = {"prompt": prompt, "deadline_ms": DEADLINE_MS}
        give_up = time.monotonic() + RETRY_FOR_S
        while True:
            try:
                async with http.post(f"{self.api}/v1/prefill", json=body, headers={"Idempotency-Key": key}) as resp:
                    if resp.status in (200, 202):  # 200: a retry found its key already used
                        rid = (await resp.json())["id"]
                        if self.ids.setdefault(key, rid) != rid:
                            self.duplicated += 1
                    else:
                        self.refused[resp.status] += 1
                    return
            except (aiohttp.ClientError, TimeoutError):  # the front door is down: retry, same key
                if time.monotonic() > give_up:
                    self.refused[0] += 1
                    return
                self.retries += 1
                await asyncio.sleep(0.5)

    async def settle(self, http: aiohttp.ClientSession, timeout: float) -> dict[str, str]:
        """Every accepted request's final status (`done`, `failed:<reason>`), or its last one."""
        final: dict[str, str] = {}
        deadline = time.monotonic() + timeout
        todo = set(self.ids.values())
        while todo and time.monotonic() < deadline:
            for rid in list(todo):
                try:
                    async with http.get(f"{self.api}/v1/prefill/{rid}") as resp:
                        data = await resp.json() if resp.status < 500 else {}
                except (aiohttp.ClientError, TimeoutError):
                    continue
                st = data.get("status", f"http-{resp.status}")
                final[rid] = st if st != "failed" else f"failed:{data.get('reason')}"
                if st in ("done", "failed"):
                    todo.discard(rid)
            if todo:
                await asyncio.sleep(1.0)  # a poll of stored statuses: there is no push to wait on
        return final


async def stop_up(proc: asyncio.subprocess.Process) -> None:
    """SIGTERM, as a service manager stops it; SIGKILL only if it does not stop in 90 s."""
    proc.send_signal(signal.SIGTERM)
    try:
        await asyncio.wait_for(proc.wait(), 90)
    except TimeoutError:
        proc.kill()
        await proc.wait()


async def wait_ready(http: aiohttp.ClientSession, api: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            async with http.get(f"{api}/ready") as resp:
                if resp.status == 200:
                    return
        except (aiohttp.ClientError, TimeoutError):
            pass
        await asyncio.sleep(0.5)  # /ready is the only signal there is
    raise SystemExit(f"serving not ready within {timeout:.0f}s")


def iterations_done(url: str, run: str) -> list[IterationDone]:
    """Every "iteration done" report of the run, in the order sent."""
    r = sync_client_for(url, protocol=None)
    try:
        return [m for _, f in r.xrange(keys.events_stream(run)) if isinstance(m := decode(f[b"m"]), IterationDone)]
    finally:
        r.close()


def training_figures(done: list[IterationDone], spec: ClusterSpec) -> dict[str, Any]:
    """Did training resume after the worker kills, and are its losses those of an uninterrupted run
    of `spec` (the spec the run trained: until stopped, with its own learning-rate schedule)?"""
    losses: dict[int, dict[tuple[int, int], list[tuple[int, float]]]] = {}
    for m in done:
        if m.loss is not None:
            losses.setdefault(m.iteration, {}).setdefault((m.replica, m.stage), []).append((m.generation, m.loss))
    # Every replica's reported loss against the reference's for that replica: an iteration one
    # replica stepped while another's step never came (its worker lost; the run went on from the
    # first's state) has the first's loss only, and is checked all the same.
    n = max(losses, default=-1) + 1
    expected: list[list[float]] = []
    if n:
        train_reference_for(spec, iterations=n, per_replica=expected)
    pairs = [(i, d, max(v)[1]) for i in sorted(losses) for (d, _), v in losses[i].items()]
    replays = [abs(a[1] - b[1]) for i in losses for v in losses[i].values() for a, b in itertools.pairwise(v)]
    errs = [abs(loss - expected[i][d]) for i, d, loss in pairs]
    unequal = [i for (i, _, _), e in zip(pairs, errs, strict=True) if e > LOSS_TOLERANCE]
    generations = sorted({m.generation for m in done})
    return {
        "iterations_checked": len(losses),
        "iterations_trained_twice": len(replays),
        "generations": len(generations),
        "training_resumed": len(generations) > 1 and any(m.generation == generations[-1] for m in done),
        "loss_max_abs_err": max(errs, default=0.0),
        "first_unequal_iteration": min(unequal, default=None),
        "replay_max_abs_err": max(replays, default=0.0),
        "losses_equal": bool(n) and all(e <= LOSS_TOLERANCE for e in errs + replays),
    }


def verdict(training: dict[str, Any], lost: int, duplicated: int, up_exit_code: int | None) -> dict[str, Any]:
    """`valid` and `why` (is the run's training what an uninterrupted run trains?), apart from the
    claims; `claims_met` only for a valid run whose every claim holds."""
    problems = []
    if not training["iterations_checked"]:
        problems.append("no iteration has a loss from every replica: nothing was compared with the reference")
    elif not training["losses_equal"]:
        if (first := training["first_unequal_iteration"]) is not None:
            problems.append(
                f"losses differ from single-process training of the run's spec from iteration {first} "
                f"(largest error {training['loss_max_abs_err']:.3g}, tolerance {LOSS_TOLERANCE:g})"
            )
        if training["replay_max_abs_err"] > LOSS_TOLERANCE:
            problems.append(f"an iteration trained twice gave another loss (by {training['replay_max_abs_err']:.3g})")
    why = "; ".join(problems) or (
        f"every iteration's loss ({training['iterations_checked']} checked, {training['iterations_trained_twice']} "
        f"trained twice) equals single-process training of the run's spec within {LOSS_TOLERANCE:g}"
    )
    claims = {
        "nothing_lost": lost == 0,
        "nothing_duplicated": duplicated == 0,
        "training_resumed": bool(training["training_resumed"]),
        "up_stopped_cleanly": up_exit_code == 0,
    }
    return {"valid": not problems, "why": why, "claims": claims, "claims_met": not problems and all(claims.values())}


async def chaos(args: argparse.Namespace) -> dict[str, Any]:
    out = Path(tempfile.mkdtemp(prefix="bubbletea-chaos-"))
    redis_dir = out / "redis"
    redis_dir.mkdir()
    redis_srv = EmbeddedRedis(persist=True, data_dir=str(redis_dir)).start()
    port = free_port()
    run = f"chaos-{uuid.uuid4().hex[:6]}"
    env = {**os.environ, "REDIS_URL": redis_srv.url, "BUBBLETEA_HTTP_PORT": str(port), "BUBBLETEA_RUN": run}
    env.pop("BUBBLETEA_API_KEY", None)
    env.pop("BUBBLETEA_DECAY_ITERS", None)
    if args.decay_iters:  # the learning rate of a run that trains until stopped decays to here
        env["BUBBLETEA_DECAY_ITERS"] = str(args.decay_iters)
    proc = await asyncio.create_subprocess_exec(
        *(sys.executable, "-m", "bubbletea.cli", "up", "--config", args.config, "--out", str(out)),
        env=env,
        cwd=ROOT,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
    )
    up = Up(proc)
    api = f"http://127.0.0.1:{port}"
    load = Load(api, args.rate)
    faults: list[dict[str, Any]] = []
    t0 = time.monotonic()
    try:
        await up.wait_for(r"Ctrl-C stops everything", 240)
        workers = sorted(label for label in up.pids if label.startswith("stage_worker-"))
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=15)) as http:
            loader = asyncio.create_task(load.run(http))
            await asyncio.sleep(args.gap)
            for rnd in range(args.rounds):
                for pattern in SERVICES:
                    label = pattern.format(rnd % len(workers))
                    since, started = len(up.lines), time.monotonic()
                    os.kill(up.pids[label], signal.SIGKILL)
                    await up.wait_for(rf"==> {re.escape(label)} restarted \(pid \d+\): healthy", 180, since)
                    faults.append({"round": rnd, "killed": label, "back_after_s": round(time.monotonic() - started, 1)})
                    print(json.dumps(faults[-1]), flush=True)
                    await asyncio.sleep(args.gap)
                started = time.monotonic()
                redis_srv.kill()  # SIGKILL: the append-only file (fsync always) is all that survives
                await asyncio.sleep(REDIS_DOWN_S)
                redis_srv = EmbeddedRedis(port=redis_srv.port, persist=True, data_dir=str(redis_dir)).start()
                await wait_ready(http, api, 120)
                faults.append({"round": rnd, "killed": "redis", "back_after_s": round(time.monotonic() - started, 1)})
                print(json.dumps(faults[-1]), flush=True)
                await asyncio.sleep(args.gap)
            load.stop.set()
            await loader
            final = await load.settle(http, DEADLINE_MS / 1000 + 60)
        settled_s = round(time.monotonic() - t0, 1)
        await stop_up(proc)  # training stops: every iteration it reported is checked, on a quiet machine
        # the spec `up` gave its services (until stopped, with the learning-rate horizon), not --config
        trained = load_spec(out / run / "spec.yaml")
        done = await asyncio.to_thread(iterations_done, redis_srv.url, run)
        training = await asyncio.to_thread(training_figures, done, trained)
    finally:
        if proc.returncode is None:
            await stop_up(proc)
        await asyncio.gather(up.reader, return_exceptions=True)
        redis_srv.stop()
        (out / "up.out").write_text("\n".join(up.lines) + "\n")
        print(f"bubbletea up's output and the run folder: {out}", flush=True)
    statuses = Counter(final.get(rid, "unknown") for rid in load.ids.values())
    lost = sum(n for st, n in statuses.items() if st not in ("done",) and not st.startswith("failed:"))
    restarts = Counter(m.group(1) for line in up.lines if (m := re.search(r"==> (\S+) restarted \(pid", line)))
    scales = [float(m.group(1)) for line in up.lines if (m := re.search(r"device time scale ([0-9.]+)", line))]
    return {
        **verdict(training, lost, load.duplicated, proc.returncode),
        "time_scale_k": scales[0] if scales else None,  # what `up` measured and ran at
        "rounds": args.rounds,
        "rate": args.rate,
        "decay_iters": trained.training.decay_iters,
        "faults": len(faults),
        "accepted": len(load.ids),
        "answered": statuses.get("done", 0),
        "failed": {st.removeprefix("failed:"): n for st, n in statuses.items() if st.startswith("failed:")},
        "refused": {str(k): v for k, v in load.refused.items()},
        "client_retries": load.retries,
        "lost": lost,
        "duplicated": load.duplicated,
        **training,
        "restarts": dict(restarts),
        "up_exit_code": proc.returncode,
        "max_back_after_s": max((f["back_after_s"] for f in faults), default=0.0),
        # from Redis's SIGKILL to the front door's /ready, its REDIS_DOWN_S down included
        "redis_back_after_s": [f["back_after_s"] for f in faults if f["killed"] == "redis"],
        "settled_after_s": settled_s,
        "seconds": round(time.monotonic() - t0, 1),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=3, help="rounds of faults (default 3)")
    p.add_argument("--rate", type=float, default=10.0, help="requests per second (default 10)")
    p.add_argument("--gap", type=float, default=10.0, help="seconds of load between faults (default 10)")
    p.add_argument(
        "--decay-iters",
        type=int,
        default=DECAY_ITERS,
        help=f"where the run's cosine learning rate ends (default {DECAY_ITERS}; 0: the spec's, and a run "
        "trained until stopped without one keeps lr)",
    )
    p.add_argument("--quick", action="store_true", help="one round, 6 s between faults (a few minutes)")
    p.add_argument("--config", default=str(ROOT / "configs" / "demo.yaml"), help="the spec `up` runs")
    args = p.parse_args(argv)
    if args.decay_iters < 0:
        p.error(f"--decay-iters must be >= 0, got {args.decay_iters}")
    if args.quick:
        args.rounds, args.gap = 1, 6.0
    result = asyncio.run(chaos(args))
    print(json.dumps(result))
    return 0 if result["claims_met"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
