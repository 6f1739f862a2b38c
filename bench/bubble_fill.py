"""BubbleTea benchmark: the same training run with prefill in its bubbles off and on, in pairs.

Every run uses the same spec and seed (WAN-bound, with a training device profile:
configs/wan-bound.yaml) over real services on a private redis-server. With BubbleTea on, the load
generator (its own process) keeps `--concurrency` prefill requests in flight over real HTTP
(`POST /v1/completions`, closed loop) for the whole run, so requests are waiting whenever a bubble
opens: it starts once the workers hold their slots (requests wait while they set up) and lasts as long
as the run with BubbleTea off took from its launch; should it end later than the spec's iterations,
training goes on until it is done, and those extra iterations are left out of every figure. Runs
go off, on, off, on, ... (`--pairs` interleaved pairs, so slow drift of a shared machine
hits both sides); a case's figure is the median over its pairs, and latency percentiles are over
the bubbles of all its pairs.

Cases: DP=2 (four workers) and DP=1 (two), each in two modes:
* ``profiled``: prefill counts for the spec's prefill profile (each block = one layer of one prompt
  = 0.25 ms + 8 us per token, padded in the worker; compute slower than that is reported as lag);
* ``raw``: prefill counts for its real CPU compute time.

    python bench/bubble_fill.py            # every case, 3 pairs of 16 iterations each
    python bench/bubble_fill.py --quick    # the headline case only (DP=2, profiled), 3 pairs of 8

Prints a table per case and one JSON line per case; the last line is always the headline case.
Keys: dispatch_p50_ms / dispatch_p99_ms (bubble start on the worker -> its first prefill running;
over every bubble, and in _steady over iterations after the first, the window of the other
per-bubble figures; the service takes requests while the workers set up, and each worker's first
batch is staged as it joins, so the first bubbles start as later ones do),
bubble_fill_ratio (prefill time / bubble time, steady window), device_time_scale (one profiled ms
= K real ms: measured and chosen first unless --time-scale K; iter_ms_off / iter_ms_on are in
emulated ms, the latencies and tokens/s on the real clock),
prefill_lag_pct (prefill lag over prefill time, %), cpu_share_max (the busiest process's CPU share
in the BubbleTea runs, 1.0 = one core; per service in cpu_share_by_service), utilization_off / utilization_on
(training + prefill time / window, mean over workers), train_slowdown_pct (median over pairs of
steady iteration time on vs off), prediction_error_p50_ms / _p90_ms (|actual - predicted| bubble
length), overrun_p50_ms / _p99_ms (training input arrived -> training resumed, per filled bubble),
prefill_lag_ms_on (real prefill compute behind the profile), prefill_tokens_per_s, ttft_p50_ms /
ttft_p99_ms (HTTP request to answer), requests_lost (accepted but neither answered nor failed
explicitly), losses_equal (bit-identical training losses on and off), mode, pairs.

`errors` counts explicit failures by HTTP status (a request whose 5 s deadline passed before a
bubble could take it: 504; one refused because the run had finished: 503), not lost.

Over 300 lines on purpose: one benchmark (the spec, a run off and on with its load, and the figures
over its pairs), read top to bottom.
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import io
import json
import os
import random
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import uvloop
import yaml
from redis.asyncio import Redis

from bubbletea.launcher.load import run_loadgen
from bubbletea.launcher.procs import front_door
from bubbletea.launcher.train import TrainResult, run_training
from bubbletea.runstats import (
    Span,
    dispatch_latencies_ms,
    median,
    overruns_ms,
    percentile,
    prediction_errors_ms,
    prefill_lag_share,
    run_spans,
    steady,
    utilization,
)
from shared.config import parse_spec
from shared.priority import PRIORITIES
from shared.redis_server import EmbeddedRedis
from shared.settings import load_settings
from shared.timescale import calibrate

ROOT = Path(__file__).resolve().parent.parent
BASE: dict[str, Any] = yaml.safe_load((ROOT / "configs" / "wan-bound.yaml").read_text())


#: The profiled mode's prefill cost per block (one layer of one prompt): ~1 ms for the load's
#: ~96-token prompts, half the guard, and 2-3x this CPU's real compute for the benchmark's model.
PREFILL_PROFILE = {"prefill_ms_per_layer": 0.25, "prefill_us_per_token": 8.0}
MODES = ("profiled", "raw")


def bench_spec(*, enabled: bool, iterations: int, dp: int, mode: str = "profiled") -> dict[str, Any]:
    spec = copy.deepcopy(BASE)
    if mode == "profiled":
        spec["device"] |= PREFILL_PROFILE
    spec["name"] = "bubbletea-bench"
    spec["parallelism"]["dp"] = dp
    spec["training"]["iterations"] = iterations
    spec["bubbletea"] = {"enabled": enabled, "guard_ms": 2.0, "dispatch_overhead_ms": 1.0, "max_batch_requests": 16}
    spec["prefill"] = {
        "model": {"layers": 4, "d_model": 64, "heads": 4, "seq_len": 256, "vocab": 256, "seed": 0},
        "max_prompt_tokens": 256,
        # Unanswered requests fail explicitly 5 s after the run: the benchmark's tail stays short.
        "request_timeout_s": 5,
        # KV caches are not kept: at benchmark throughput they would be hundreds of MB per second.
        "kv_ttl_s": 0,
    }
    return spec


async def load(api: str, concurrency: int, duration_s: float, out: Path) -> dict[str, Any]:
    """The load generator: `concurrency` requests always in flight (closed loop), from the moment
    the run serves (every worker joined: training starts), for `duration_s`."""
    args = ["--base-url", api, "--request-rate", "inf", "--max-concurrency", str(concurrency)]
    args += ["--duration", f"{duration_s:.2f}", "--num-prompts", "1000000", "--input-len", "96"]
    args += ["--range-ratio", "0.33", "--seed", "1"]
    return await run_loadgen(args, out)


class CpuSampler:
    """Every `PERIOD_S`, the CPU time (user + system) of this process and of every process it
    started, directly or not (/proc): each one's share of one core while it was seen (1.0 = a
    whole core). Keyed "<service>:<pid>"."""

    PERIOD_S = 0.25

    def __init__(self) -> None:
        self.first: dict[int, tuple[float, float]] = {}
        self.last: dict[int, tuple[float, float]] = {}
        self.names: dict[int, str] = {}
        self.tick = os.sysconf("SC_CLK_TCK")

    async def run(self) -> None:
        while True:
            await asyncio.to_thread(self.sample)
            await asyncio.sleep(self.PERIOD_S)

    def sample(self) -> None:
        now, parent, cpu = time.monotonic(), {}, {}
        for d in Path("/proc").iterdir():
            if not d.name.isdigit():
                continue
            try:
                fields = (d / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            pid = int(d.name)
            parent[pid] = int(fields[1])
            cpu[pid] = (int(fields[11]) + int(fields[12])) / self.tick  # utime + stime
        mine, frontier = {os.getpid()}, [os.getpid()]
        while frontier:
            kids = [p for p, pp in parent.items() if pp in frontier and p not in mine]
            mine.update(kids)
            frontier = kids
        for pid in mine:
            self.first.setdefault(pid, (now, cpu[pid]))
            self.last[pid] = (now, cpu[pid])
            if pid not in self.names:
                self.names[pid] = _service_name(pid)

    def shares(self) -> dict[str, float]:
        out = {}
        for pid, (t1, c1) in self.last.items():
            t0, c0 = self.first[pid]
            if t1 - t0 >= 1.0:
                out[f"{self.names[pid]}:{pid}"] = round((c1 - c0) / (t1 - t0), 3)
        return out


def _service_name(pid: int) -> str:
    try:
        args = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return "?"
    words = [a.decode(errors="replace") for a in args if a]
    for w in words:
        if w.startswith("services.") or w in ("loadgen", "bench/bubble_fill.py"):
            return w.removeprefix("services.")
    return Path(words[0]).name if words else "?"


async def one_run(
    url: str,
    workdir: Path,
    *,
    enabled: bool,
    iterations: int,
    dp: int,
    concurrency: int,
    mode: str,
    load_s: float = 0.0,
) -> tuple[TrainResult, dict[str, Any]]:
    spec = bench_spec(enabled=enabled, iterations=iterations, dp=dp, mode=mode)
    path = workdir / f"bt-{'on' if enabled else 'off'}.yaml"
    path.write_text(yaml.safe_dump(spec))
    run = f"bench-bt-{'on' if enabled else 'off'}-{random.randrange(1 << 30):x}"
    settings = load_settings(path, env={"BUBBLETEA_RUN": run})
    out = io.StringIO()
    extra: dict[str, Any] = {}
    launched = time.monotonic()
    if not enabled:
        result = await run_training(settings, url, out=out, progress=False, quiet=True)
    else:
        env = {"REDIS_URL": url, "BUBBLETEA_CONFIG": str(path)}
        sampler = CpuSampler()
        sampling = asyncio.create_task(sampler.run())
        try:
            async with front_door(env, out=out) as door:
                assert door.url is not None
                client = asyncio.create_task(load(door.url, concurrency, load_s, workdir / "loadgen.json"))
                # trains on past the spec's iterations until the load is done (those are left out
                # below): every bubble of the spec's iterations has requests waiting, the last too
                result = await run_training(
                    settings, url, out=out, progress=False, quiet=True, dispatcher=True, until=client
                )
                extra = {"load": await client}
        finally:
            sampling.cancel()
            await asyncio.gather(sampling, return_exceptions=True)
        extra["cpu"] = sampler.shares()
    extra["wall_s"] = time.monotonic() - launched
    r = Redis.from_url(url)
    try:
        spans = [s for s in await run_spans(r, run) if s.iteration < iterations]
    finally:
        await r.aclose()
    return result, {"spans": spans, **extra}


@dataclass
class Pair:
    off: TrainResult
    on: TrainResult
    spans_off: list[Span]
    spans_on: list[Span]
    load: dict[str, Any]
    cpu: dict[str, float]  # the BubbleTea run's processes: share of one core each


async def run_case(
    url: str, workdir: Path, *, dp: int, mode: str, pairs: int, iterations: int, concurrency: int
) -> dict[str, Any]:
    """`pairs` interleaved off/on runs of one case, summarised."""
    done: list[Pair] = []
    for i in range(pairs):
        print(f"  dp={dp} {mode}: pair {i + 1}/{pairs}", file=sys.stderr, flush=True)
        kw: dict[str, Any] = {"iterations": iterations, "dp": dp, "concurrency": concurrency, "mode": mode}
        off, off_t = await one_run(url, workdir, enabled=False, **kw)
        # closed loop for the whole run: the load, which starts once the workers hold their slots
        # and set up, lasts as long as the run with BubbleTea off took from its launch
        on, on_t = await one_run(url, workdir, enabled=True, load_s=off_t["wall_s"], **kw)
        done.append(Pair(off, on, off_t["spans"], on_t["spans"], on_t["load"], on_t["cpu"]))
    return summarise(done, dp=dp, mode=mode, iterations=iterations, concurrency=concurrency)


def _by_service(runs: Any) -> dict[str, float]:
    out: dict[str, float] = {}
    for cpu in runs:
        for key, share in cpu.items():
            name = key.rsplit(":", 1)[0]
            out[name] = max(out.get(name, 0.0), share)
    return dict(sorted(out.items(), key=lambda kv: -kv[1]))


def summarise(pairs: list[Pair], **case: Any) -> dict[str, Any]:
    def med(values: list[float]) -> float:
        return float(median(values) or 0.0)

    scale = float(os.environ.get("BUBBLETEA_TIME_SCALE", "1"))

    u_off = [utilization(p.spans_off) for p in pairs]
    u_on = [utilization(p.spans_on) for p in pairs]
    slowdowns = [(p.on.steady_iteration_s() / p.off.steady_iteration_s() - 1) * 100 for p in pairs]
    dispatch = [x for p in pairs for x in dispatch_latencies_ms(p.spans_on)]
    # the same latencies over the window of every other per-bubble figure (iterations after the first)
    dispatch_steady = [x for p in pairs for x in dispatch_latencies_ms(steady(p.spans_on))]
    errors_ms = [x for p in pairs for x in prediction_errors_ms(p.spans_on)]
    overrun = [x for p in pairs for x in overruns_ms(p.spans_on)]
    ttft = [x for p in pairs for x in p.load["ttfts_ms"]]
    errors: dict[str, int] = {}
    for p in pairs:
        for k, n in p.load["error_counts"].items():
            errors[k] = errors.get(k, 0) + n
    return {
        **case,
        "pairs": len(pairs),
        # emulated ms: real seconds over the device time scale
        "iter_ms_off": round(med([p.off.steady_iteration_s() for p in pairs]) * 1000 / scale, 2),
        "iter_ms_on": round(med([p.on.steady_iteration_s() for p in pairs]) * 1000 / scale, 2),
        "train_slowdown_pct": round(med(slowdowns), 2),
        "train_slowdown_pct_pairs": [round(x, 2) for x in slowdowns],
        # how far real compute fell behind the device profile, summed over workers and iterations
        "lag_ms_off": round(med([p.off.lag_ms for p in pairs]), 1),
        "lag_ms_on": round(med([p.on.lag_ms for p in pairs]), 1),
        "prefill_lag_ms_on": round(med([p.on.prefill_lag_ms for p in pairs]), 1),
        # prefill lag over prefill time (both real), percent: how far the real prefill compute ran
        # behind the profile it pads to
        "prefill_lag_pct": round(med([100 * prefill_lag_share(p.on.prefill_lag_ms, p.spans_on) for p in pairs]), 2),
        "bubble_fraction_off": round(med([u.bubble for u in u_off]), 3),
        "utilization_off": round(med([u.busy for u in u_off]), 3),
        "utilization_on": round(med([u.busy for u in u_on]), 3),
        "bubble_fill_ratio": round(med([u.fill_ratio for u in u_on]), 3),
        "dispatch_p50_ms": _r(median(dispatch)),
        "dispatch_p99_ms": _r(percentile(dispatch, 99)),
        "bubbles_dispatched": len(dispatch),
        "dispatch_p50_ms_steady": _r(median(dispatch_steady)),
        "dispatch_p99_ms_steady": _r(percentile(dispatch_steady, 99)),
        "prediction_error_p50_ms": _r(median(errors_ms)),
        "prediction_error_p90_ms": _r(percentile(errors_ms, 90)),
        "overrun_p50_ms": _r(median(overrun)),
        "overrun_p99_ms": _r(percentile(overrun, 99)),
        "prefill_tokens_per_s": round(med([p.load["input_throughput"] for p in pairs]), 1),
        "requests_answered": sum(p.load["completed"] for p in pairs),
        "ttft_p50_ms": _r(median(ttft)),
        "ttft_p99_ms": _r(percentile(ttft, 99)),
        "errors": errors,
        # accepted but never answered nor failed explicitly (an HTTP status is an explicit answer)
        "requests_lost": sum(n for k, n in errors.items() if not k.isdigit()),
        "losses_equal": all(p.off.losses == p.on.losses for p in pairs),
        # each process's CPU share in the BubbleTea runs (1.0 = one whole core): the largest, and
        # per service the largest over its processes and pairs
        "cpu_share_max": round(max((x for p in pairs for x in p.cpu.values()), default=0.0), 3),
        "cpu_share_by_service": _by_service(p.cpu for p in pairs),
    }


async def bench(cases: list[tuple[int, str]], *, pairs: int, iterations: int, concurrency: int) -> list[dict[str, Any]]:
    out = []
    with tempfile.TemporaryDirectory() as tmp:
        async with EmbeddedRedis() as redis:
            for dp, mode in cases:
                kw: dict[str, Any] = {
                    "dp": dp,
                    "mode": mode,
                    "pairs": pairs,
                    "iterations": iterations,
                    "concurrency": concurrency,
                }
                out.append(await run_case(redis.url, Path(tmp), **kw))
    return out


def time_scale(arg: str, dp: int) -> float:
    """`--time-scale`: a number, or `auto`: this machine measured with the workers of the largest
    case computing at once (shared/timescale.py)."""
    if arg != "auto":
        return float(arg)
    spec = parse_spec(bench_spec(enabled=True, iterations=1, dp=dp))
    cal = calibrate(spec)
    print(cal.line(), file=sys.stderr, flush=True)
    return cal.scale


def _r(v: float | None) -> float | None:
    return None if v is None else round(v, 3)


#: The case the last JSON line always reports: the one the targets are set for.
HEADLINE = (2, "profiled")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="only the headline case (DP=2, profiled), 8 iterations a run")
    ap.add_argument("--dp", type=int, choices=(1, 2), help="only this DP degree (workers = 2 x DP)")
    ap.add_argument("--mode", choices=MODES, help="only this prefill mode")
    ap.add_argument("--pairs", type=int, default=3, help="interleaved off/on pairs per case; default 3")
    ap.add_argument("--iterations", type=int, help="training iterations per run; default 8 with --quick, else 16")
    # 128: enough that requests are always waiting when a bubble ends. With 32, then (once the
    # step's wait was a bubble too, 2026-11-26) with 64, four workers' open bubbles and staged
    # batches emptied the queue at bubble ends, and the bubble after a step opened with nothing
    # staged: dispatch p99 21 ms against 8.6 ms at 64 then; 4.5 ms in one of three runs at 64
    # against 0.15 ms at 128 now (more requests then fail their 5 s deadline while queued: 504s)
    ap.add_argument("--concurrency", type=int, default=128, help="requests the client keeps in flight; default 128")
    ap.add_argument(
        "--time-scale",
        default="auto",
        metavar="K",
        help="the device time scale (one profiled ms = K real ms, shared/timescale.py): auto (the default) "
        "measures this machine first and picks it; or a number >= 1",
    )
    ap.add_argument(
        "--priority",
        choices=PRIORITIES,
        default="low",
        help="the workers' torch threads below the event loops (low, the default) or not (normal): "
        "BUBBLETEA_COMPUTE_PRIORITY, shared/priority.py",
    )
    args = ap.parse_args(argv)
    os.environ["BUBBLETEA_COMPUTE_PRIORITY"] = args.priority  # the services inherit it
    if args.pairs < 1:
        ap.error("--pairs must be at least 1")
    if args.quick:
        cases = [HEADLINE]
    else:
        cases = [(dp, mode) for dp in (2, 1) for mode in MODES]
        cases = [c for c in cases if (args.dp in (None, c[0])) and (args.mode in (None, c[1]))]
        cases.sort(key=lambda c: c == HEADLINE)  # the headline case last
    iterations = args.iterations or (8 if args.quick else 16)
    scale = time_scale(args.time_scale, max(dp for dp, _ in cases))
    os.environ["BUBBLETEA_TIME_SCALE"] = f"{scale:g}"  # the services inherit it
    t0 = time.perf_counter()
    results = uvloop.run(bench(cases, pairs=args.pairs, iterations=iterations, concurrency=args.concurrency))
    for res in results:
        res["bench_s"] = round(time.perf_counter() - t0, 1)
        res["compute_priority"] = args.priority
        res["device_time_scale"] = scale
        print(f"== dp={res['dp']} mode={res['mode']}", file=sys.stderr)
        for k, v in res.items():
            print(f"{k:<26} {v}", file=sys.stderr)
    for res in results:
        print(json.dumps(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
