"""The dispatcher's capacity: a real dispatcher process and a real redis-server, fed by emulated
stage workers (bench/lib/emulated_workers.py: bubbles, batches taken, reports; no torch) and an
open-loop injector process (bench/lib/injector.py; several for the saturating case) that accepts
Poisson requests straight into Redis (the front door's own accept script: the front door is not
what is measured here).

Cases: 1, 4 and 16 emulated replicas (PP=2, so 2, 8 and 32 workers) at 1x and 4x the GPU check's
904 requests/s. Every worker has one bubble of 40% of a 50 ms iteration; a 96-token prompt costs
its device 0.2 ms (a small model on a GPU), so even one replica's bubbles hold 4x the load.

Figures per case (host clock, real time; the dispatcher runs at time scale 1):

* ``answered_per_s``: requests answered per second (by the emulated workers, over the measured
  window); ``dispatcher_cpu``: the dispatcher process's share of one core over that window;
  ``requests_per_core_s``: answered_per_s / dispatcher_cpu, what one core of dispatcher sustains;
  ``inputs_per_s`` / ``inputs_per_core_s``: every message the dispatcher took (requests, bubble
  starts and ends, batch reports), per second and per core-second: what sizes a job's dispatchers;
* ``decision_p50_ms`` / ``_p99``: per read of a stream, its first entry handled to its decisions
  written (the dispatcher's own figure, from its heartbeat: `Dispatcher.decision_s`);
* ``fill_p50_ms`` / ``_p99``: per request, accepted into Redis to its batch read by a worker (the
  whole control path: the request stream, the dispatcher, the worker's fill stream);
* ``refused`` / ``expired``: requests the dispatcher failed (overloaded, deadline), of ``sent``.

A last case offers as much as the injector can (``--saturate``, on by default) to show where one
dispatcher core stops. The last line is one JSON object: every case, and the headline figures.

    python bench/dispatcher.py            # every case, 12 s each
    python bench/dispatcher.py --quick    # 1 and 16 replicas at 904/s, and saturation; 6 s each
    python bench/dispatcher.py --replicas 4 --rate 2000 --seconds 10    # one case
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the checkout: bench.lib

import uvloop
import yaml
from redis.asyncio import Redis

from bench.lib.emulated_workers import PROMPT_TOKENS, Emulated, Shape, hold_slots
from bubbletea.launcher.procs import spawn, stop_all
from bubbletea.launcher.services import DISPATCHER
from shared.bus.connection import client_for
from shared.control.health import HEARTBEAT_INTERVAL_S
from shared.figures.percentiles import percentile
from shared.runtime.redis_server import EmbeddedRedis
from shared.wire import keys

#: The GPU check's offered load (bench/gpu_check.py, one H100, 2026-11-28: 80% of its bubbles).
GPU_CHECK_RPS = 904.0
SHAPE = Shape(period_s=0.050, bubble_s=0.020, request_s=0.0002)
#: The measured window starts after this warm-up (the dispatcher learns the costs and bubbles).
WARMUP_S = 2.0
SATURATE_RPS = 20_000.0


def spec(replicas: int) -> dict[str, Any]:
    return {
        "name": "dispatcher-bench",
        "datacenters": [{"name": "dc-a", "gpus": replicas}, {"name": "dc-b", "gpus": replicas}],
        "parallelism": {"pp": 2, "dp": replicas},
        "bubbletea": {"enabled": True, "max_batch_requests": 32},
        # deadlines far off: what is measured is the dispatcher's pace, not admission under overload
        "prefill": {"max_prompt_tokens": 256, "request_timeout_s": 30.0, "max_queue_depth": 10_000_000},
    }


def cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def heartbeat(url: str, after: float) -> dict[str, Any]:
    """The dispatcher's first heartbeat written at or after `after` (wall clock): one that covers the
    measured load. It beats every `HEARTBEAT_INTERVAL_S`; a dispatcher slow to start on a busy
    machine had beaten only once, before any decision, when the load ended (a CI run, 2026-12-02)."""
    r = client_for(url)
    give_up = time.monotonic() + 3 * HEARTBEAT_INTERVAL_S
    try:
        while True:
            found: Any = await r.keys(keys.health_key("dispatcher", "*"))
            raw: Any = await r.get(found[0]) if found else None
            beat = json.loads(raw) if raw else {}
            if beat.get("ts", 0.0) >= after or time.monotonic() > give_up:
                return beat
            await asyncio.sleep(0.1)
    finally:
        await r.aclose()


async def added(r: Redis, run: str) -> int | None:
    """Requests accepted into `run`'s request stream so far, trimmed ones included (XINFO's
    entries-added; its length is not it: the dispatcher trims what it has read). None before Redis 7."""
    info: Any = await r.xinfo_stream(keys.prefill_requests_stream(run))
    n = info.get("entries-added")
    return None if n is None else int(n)


async def injectors(url: str, run: str, rate: float, seconds: float, reply_to: str, n: int) -> int:
    """`n` injector processes at `rate / n` each for `seconds`, accepting for `run` (bench/lib/injector.py);
    the requests sent."""
    script = str(Path(__file__).with_name("lib") / "injector.py")
    procs = []
    for i in range(n):
        args = (url, run, str(rate / n), str(seconds), reply_to, f"i{i}-", str(i + 1))
        procs.append(
            await asyncio.create_subprocess_exec(sys.executable, script, *args, stdout=asyncio.subprocess.PIPE)
        )
    outs = await asyncio.gather(*(p.communicate() for p in procs))
    return sum(int(out.decode() or 0) for out, _ in outs)


async def run_case(
    url: str, workdir: Path, replicas: int, rate: float, seconds: float, n_injectors: int = 1
) -> dict[str, Any]:
    run = f"dbench-{replicas}-{int(rate)}-{random.randrange(1 << 20):x}"
    path = workdir / f"{run}.yaml"
    path.write_text(yaml.safe_dump(spec(replicas)))
    env = {"REDIS_URL": url, "BUBBLETEA_CONFIG": str(path), "BUBBLETEA_RUN": run, "BUBBLETEA_TIME_SCALE": "1"}
    stop = asyncio.Event()
    holder = asyncio.create_task(hold_slots(url, run, 2, replicas, stop))
    workers = [
        Emulated(run, d, k, ("dc-a", "dc-b")[k], SHAPE, i, 2 * replicas, url)
        for i, (d, k) in enumerate((d, k) for d in range(replicas) for k in range(2))
    ]
    tasks = [asyncio.create_task(w.run_until(stop)) for w in workers]
    proc = await spawn(DISPATCHER, env, out=sys.stderr, quiet=True)
    try:
        # processes of their own, not this one's event loop: the dispatcher, not the injector, the limit
        injector = asyncio.create_task(
            injectors(url, run, rate, WARMUP_S + seconds, keys.prefill_results_stream(run, "dbench"), n_injectors)
        )
        await asyncio.sleep(WARMUP_S)
        r = client_for(url)
        c0, a0, t0 = cpu_s(proc.proc.pid), sum(w.answered for w in workers), time.monotonic()
        m0, s0 = sum(w.sent for w in workers), await added(r, run)
        waits0 = [len(w.fill_waits_s) for w in workers]
        sent = await injector
        c1, a1, t1 = cpu_s(proc.proc.pid), sum(w.answered for w in workers), time.monotonic()
        m1, s1 = sum(w.sent for w in workers), await added(r, run)
        await r.aclose()
        beat = await heartbeat(url, after=time.time())
    finally:
        stop.set()
        await stop_all([proc])
        await asyncio.gather(holder, *tasks, return_exceptions=True)
    waits = [x * 1000 for w, n in zip(workers, waits0, strict=True) for x in w.fill_waits_s[n:]]
    cpu, answered = (c1 - c0) / (t1 - t0), (a1 - a0) / (t1 - t0)
    accepted = s1 - s0 if s0 is not None and s1 is not None else None
    # requests, bubble starts and ends, reports (requests as answered where Redis does not count them)
    inputs = (m1 - m0 + (accepted if accepted is not None else a1 - a0)) / (t1 - t0)
    row = {
        "replicas": replicas,
        "workers": 2 * replicas,
        "offered_rps": rate,
        "injectors": n_injectors,
        "sent": sent,
        # what the injectors managed to offer (None: a Redis that does not count it)
        "accepted_per_s": round(accepted / (t1 - t0), 1) if accepted is not None else None,
        "answered_per_s": round(answered, 1),
        "dispatcher_cpu": round(cpu, 3),
        # extrapolated to a whole core: observed only where the dispatcher ran at 0.9 core or more
        "requests_per_core_s": round(answered / cpu) if cpu > 0 else None,
        "observed_at_0_9_core": cpu >= 0.9,
        "inputs_per_s": round(inputs, 1),
        "inputs_per_core_s": round(inputs / cpu) if cpu > 0 else None,
        "decision_p50_ms": beat.get("decision_ms_p50"),
        "decision_p99_ms": beat.get("decision_ms_p99"),
        "fill_p50_ms": _r(percentile(waits, 50)),
        "fill_p99_ms": _r(percentile(waits, 99)),
        "refused": beat.get("overloaded"),
        "expired": beat.get("expired"),
    }
    print(
        f"{replicas:>2} replicas, {rate:>7.0f}/s offered: {row['answered_per_s']:>8.1f}/s answered, dispatcher "
        f"{cpu:.2f} core ({row['requests_per_core_s']}/s a core); decision p50/p99 {row['decision_p50_ms']}/"
        f"{row['decision_p99_ms']} ms; fill p50/p99 {row['fill_p50_ms']}/{row['fill_p99_ms']} ms",
        file=sys.stderr,
        flush=True,
    )
    return row


def _r(x: float | None) -> float | None:
    return None if x is None or math.isnan(x) else round(x, 3)


async def bench(cases: list[tuple[int, float]], seconds: float, n_injectors: int) -> list[dict[str, Any]]:
    """Each case on a fresh redis-server: a case that fell behind would leave its Redis busy with
    its backlog (trims, a dispatcher still draining) during the next. The saturating case gets
    `n_injectors` processes."""
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for n, rate in cases:
            async with EmbeddedRedis() as redis:
                k = n_injectors if rate == SATURATE_RPS else 1
                rows.append(await run_case(redis.url, Path(tmp), n, rate, seconds, k))
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="1 and 16 replicas at 904/s, and saturation; 6 s each")
    ap.add_argument("--seconds", type=float, help="measured seconds per case (default 12, --quick 6)")
    ap.add_argument("--no-saturate", action="store_true", help="leave out the case that offers all it can")
    ap.add_argument("--replicas", type=int, metavar="N", help="one case only: N replicas (with --rate)")
    ap.add_argument("--rate", type=float, metavar="RPS", help="one case only: this many requests/s (with --replicas)")
    ap.add_argument(
        "--injectors",
        type=int,
        default=2,
        metavar="N",
        help="injector processes for the saturating case (default 2; more on a machine with more cores)",
    )
    args = ap.parse_args(argv)
    if (args.replicas is None) != (args.rate is None):
        ap.error("--replicas and --rate go together (one case)")
    if args.replicas is not None and (args.replicas < 1 or args.rate <= 0):
        ap.error("--replicas must be at least 1 and --rate above 0")
    if args.replicas is not None:
        cases = [(args.replicas, args.rate)]
    elif args.quick:
        cases = [(1, GPU_CHECK_RPS), (16, GPU_CHECK_RPS)]
    else:
        cases = [(n, m * GPU_CHECK_RPS) for n in (1, 4, 16) for m in (1, 4)]
    if not args.no_saturate and args.replicas is None:
        cases.append((16, SATURATE_RPS))
    rows = uvloop.run(bench(cases, args.seconds or (6.0 if args.quick else 12.0), args.injectors))
    at_1000 = [r for r in rows if r["replicas"] == 16 and r["offered_rps"] == GPU_CHECK_RPS]
    saturated = [r for r in rows if r["offered_rps"] == SATURATE_RPS]
    sat = saturated[0] if saturated else {}
    out: dict[str, Any] = {
        "clock": "host (real) time; the dispatcher at time scale 1",
        # The headline is the saturating case's, as observed (issue 62: the best of all cases, per
        # core, extrapolated from a dispatcher at half a core, flattered it): what it answered a
        # second, at what share of a core, and whether that share was 0.9 or more.
        "saturated_answered_per_s": sat.get("answered_per_s"),
        "saturated_dispatcher_cpu": sat.get("dispatcher_cpu"),
        "saturated_observed_at_0_9_core": sat.get("observed_at_0_9_core"),
        "saturated_inputs_per_s": sat.get("inputs_per_s"),
        "decision_p99_ms_16_replicas_904": at_1000[0]["decision_p99_ms"] if at_1000 else None,
        "fill_p99_ms_16_replicas_904": at_1000[0]["fill_p99_ms"] if at_1000 else None,
        "shape": vars(SHAPE) | {"prompt_tokens": PROMPT_TOKENS},
        "cases": rows,
    }
    # each goal is judged on the case that measures it (None: that case was not run)
    out["targets"] = {
        "10000 answered/s observed at >= 0.9 core": (
            bool(sat["observed_at_0_9_core"]) and sat["answered_per_s"] >= 10_000 if saturated else None
        ),
        "decision_p99_ms < 2 at 16 replicas, 904/s": (
            out["decision_p99_ms_16_replicas_904"] < 2 if at_1000 and at_1000[0]["decision_p99_ms"] else None
        ),
    }
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
