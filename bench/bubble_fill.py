"""BubbleTea benchmark: the same training run with prefill in its bubbles off and on, in pairs,
under an open-loop load at a stated share of the bubbles' capacity.

Every run uses the same spec and seed (WAN-bound, with a training device profile:
configs/wan-bound.yaml) over real services on a private redis-server. A pair is a run with
BubbleTea off, then one with it on (`harness.interleave`: off, on, off, on, ...). The off run
gives the **capacity**: the prompt tokens per second its bubbles could hold (its bubble seconds per
second over every worker, over what a ~96-token prompt costs on the prefill profile;
`bubblestats.capacity_tokens_per_s`). With BubbleTea on, the load generator (its own process) sends
requests over real HTTP (`POST /v1/completions`) as Poisson arrivals at `--load` times that
capacity (default 0.8), open loop, from the moment training runs (not while the workers set up:
that queue would reach the first bubbles as a burst) for as long as the off run took; training
goes on until it is done, and the extra iterations are left out of every figure.
Each request's deadline is the TTFT objective (`--ttft-slo-ms`, device ms, default
1000): past capacity the dispatcher refuses what it could not start in time at once (429), rather
than letting it expire in the queue (504).

Cases: DP=2 (four workers) and DP=1 (two), each in two modes:
* ``profiled``: prefill counts for the spec's prefill profile (each block = one layer of one prompt
  = 0.25 ms + 8 us per token, padded in the worker; compute slower than that is reported as lag);
* ``raw``: prefill counts for its real CPU compute time.

    python bench/bubble_fill.py                 # every case, 3 pairs of 16 iterations each
    python bench/bubble_fill.py --quick         # the headline case only (DP=2, profiled), 3 pairs of 8
    python bench/bubble_fill.py --quick --load 1.2
    python bench/bubble_fill.py --quick --sweep # 50, 80, 100, 120% of capacity: a table and a picture

Prints a table per case and one JSON line per case; the last line is always the headline case.
Every key names its clock (`harness`: ``_device_ms`` is device time, real ms / k; ``_ms`` alone
is host time). Every bubble and every request counts:

* dispatch_p50_ms / dispatch_p99_ms: bubble start on the worker to its first prefill running, over
  every bubble that opened with work held on its worker or waiting; one that stayed empty counts
  at its whole length (bubbles_total, bubbles_with_work, bubbles_filled beside them);
* control_share_p50 / _p99: host latencies (bubble start to prefill running; a worker's report to
  the dispatcher) as a share of the mean bubble in device time: what they would be at k = 1;
* slo_attainment: the share of requests *sent* answered within the objective (a 429, a 504 or any
  failure is a miss); ttft_p50_device_ms / _p99 over those answered;
* bubble_fill_ratio: prefill time inside the bubbles (start to the training input's arrival) over
  bubble time; prefill past the arrival is overrun_device_ms_total, not fill;
* train_slowdown_mean_pct: median over pairs of the steady mean iteration time (wall time over
  iterations, the first left out) on vs off: what the goals use; train_p90_on_over_off: the p90
  iteration's ratio; train_slowdown_pct: the same of the median iteration (a median cannot see
  the slowed minority of iterations);
* valid / why: the emulation's checks (prefill kept its profile, same losses, every bubble
  recorded), apart from the claims; targets / targets_met: the issue's goals, met only if valid.

Here: the cases, their pairs and goals, the sweep, the command line; one run (its spec, its load,
what it recorded) is bench/lib/bubble_fill_run.py; the figures are `harness.summarise`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the checkout: bench.lib

import uvloop

from bench.lib import harness, sim_fit
from bench.lib.bubble_fill_run import ALL_MODES, MODES, PROMPT_TOKENS, bench_spec, one_run
from bench.lib.cpu_shares import by_service
from bench.lib.gpu_job import SIZES, Prepared, prepare
from bubbletea.launcher.train import TrainResult
from bubbletea.progress import StepBar, say
from shared.config.env_values import PRIORITIES
from shared.config.spec import parse_spec
from shared.figures.capacity import offer, prefill_block_s
from shared.model.calibration import calibrate
from shared.model.shape import model_info
from shared.runtime.redis_cluster import EmbeddedCluster
from shared.runtime.redis_server import EmbeddedRedis


async def run_case(
    url: str,
    workdir: Path,
    *,
    dp: int,
    mode: str,
    pairs: int,
    iterations: int,
    share: float,
    slo_device_ms: float,
    k: float,
    max_rate: float | None = None,
    dump: Path | None = None,
    job: Prepared | None = None,
    sim: bool = False,
    dispatch: str = "one",
) -> dict[str, Any]:
    """`pairs` interleaved off/on runs of one case, the on runs offered `share` of the capacity
    their off run measured (at most `max_rate` requests per real second), summarised
    (`harness.summarise`)."""
    kw: dict[str, Any] = {"iterations": iterations, "dp": dp, "mode": mode, "slo_device_ms": slo_device_ms}
    kw["dump"], kw["job"], kw["dispatch"] = dump, job, dispatch
    spec = parse_spec(bench_spec(enabled=True, iterations=1, dp=dp, mode=mode, job=job))
    tokens = PROMPT_TOKENS if job is None else job.prompt_tokens  # the load's mean prompt
    cost = prefill_block_s(spec, k, round(tokens))

    async def off(i: int) -> tuple[TrainResult, dict[str, Any]]:
        say(f"  dp={dp} {mode} load={share:.0%}: pair {i + 1}/{pairs}", sys.stderr)
        return await one_run(url, workdir, enabled=False, **kw)

    async def on(i: int, got: tuple[TrainResult, dict[str, Any]]) -> harness.Pair:
        result_off, off_t = got
        offered = offer(off_t["spans"], cost, model_info(spec.prefill).layers, tokens, share)
        rate = offered.rate_per_s if max_rate is None else min(offered.rate_per_s, max_rate)
        capped = f"; capped at --max-rate {max_rate:g}/s" if rate < offered.rate_per_s else ""
        say(f"    {offered.line(share, k)}{capped}", sys.stderr)
        # the load, which starts once the workers hold their slots and set up, lasts as long as
        # the run with BubbleTea off took from its launch
        result_on, on_t = await one_run(url, workdir, enabled=True, rate=rate, load_s=off_t["wall_s"], record=sim, **kw)
        last[:] = [result_off, off_t, result_on, on_t]
        return harness.Pair(
            iteration_s_off=result_off.steady_iteration_s(),
            iteration_s_on=result_on.steady_iteration_s(),
            iterations_off=list(result_off.iteration_s),
            iterations_on=list(result_on.iteration_s),
            spans_off=off_t["spans"],
            spans_on=on_t["spans"],
            seen=on_t["seen"],
            load=on_t["load"],
            prefill_lag_ms=result_on.prefill_lag_ms,
            losses_equal=result_off.losses == result_on.losses,
            capacity_tokens_per_s=offered.capacity_tokens_per_s,
            offered_rps=rate,
            cpu=on_t["cpu"],
        )

    last: list[Any] = []  # the last pair's results and records (--sim)
    done: list[harness.Pair] = await harness.interleave(pairs, off, on)
    out = {"dp": dp, "mode": mode, "iterations": iterations, "offered_share": share}
    out |= harness.summarise(done, time_scale=k, slo_device_ms=slo_device_ms)
    if sim:
        out |= await asyncio.to_thread(sim_fit.compare_last, last, iterations)
    out |= harness.targets(out, GOALS[min(GOALS, key=lambda g: abs(g - share))])
    out["cpu_share_by_service"] = by_service(p.cpu for p in done)
    return out


#: The goals, by offered share: at 80% of capacity the objective is met for (nearly) every request
#: sent and the bubbles carry 0.9 of what was offered; past capacity the bubbles are nearly full and
#: the excess refused (429), none left to expire (504). Training slows by under 1% either way. The
#: control plane's own latencies: a bubble's work running within 3 real ms of its start, a batch's
#: report at the dispatcher within 3 ms of leaving its worker.
def _below(value: float | None, limit: float) -> bool:
    """A latency goal: met only where it was measured (None: no bubble had work to time)."""
    return value is not None and value < limit


GOALS: dict[float, dict[str, Any]] = {
    0.8: {
        "train_slowdown_mean_pct < 1": lambda s: _below(s["train_slowdown_mean_pct"], 1),
        "slo_attainment >= 0.99": lambda s: (s["slo_attainment"] or 0) >= 0.99,
        "bubble_fill_ratio >= 0.72": lambda s: s["bubble_fill_ratio"] >= 0.72,
        "dispatch_p99_real_ms < 3": lambda s: _below(s["dispatch_p99_real_ms"], 3),
        "report_p99_ms < 3": lambda s: _below(s["report_p99_ms"], 3),
        "control_share_p99 < 0.05": lambda s: _below(s["control_share_p99"], 0.05),
        "requests_lost == 0": lambda s: s["requests_lost"] == 0,
    },
    1.2: {
        "train_slowdown_mean_pct < 1": lambda s: _below(s["train_slowdown_mean_pct"], 1),
        "bubble_fill_ratio >= 0.90": lambda s: s["bubble_fill_ratio"] >= 0.90,
        "excess refused (429), none expired (504)": lambda s: s["errors"].get("504", 0) == 0,
        "requests_lost == 0": lambda s: s["requests_lost"] == 0,
    },
}


async def bench(
    cases: list[tuple[int, str, float]],
    *,
    pairs: int,
    iterations: int,
    slo_device_ms: float,
    k: float,
    max_rate: float | None = None,
    dump: Path | None = None,
    job: str | None = None,
    sim: bool = False,
    redis_cluster: bool = False,
    dispatch: str = "one",
) -> list[dict[str, Any]]:
    out = []
    with tempfile.TemporaryDirectory() as tmp:
        prepared = None if job is None else await asyncio.to_thread(prepare, job, Path(tmp), 2)
        server: EmbeddedRedis | EmbeddedCluster = EmbeddedCluster() if redis_cluster else EmbeddedRedis()
        async with server as redis:
            with StepBar(len(cases), "cases", sys.stderr) as bar:  # a bar on a terminal (bubbletea.progress)
                for dp, mode, share in cases:
                    kw: dict[str, Any] = {"dp": dp, "mode": mode, "pairs": pairs, "iterations": iterations}
                    kw |= {"share": share, "slo_device_ms": slo_device_ms, "k": k, "max_rate": max_rate, "dump": dump}
                    kw["job"], kw["sim"], kw["dispatch"] = prepared, sim, dispatch
                    out.append(await run_case(redis.url, Path(tmp), **kw))
                    bar.advance()
    return out


def time_scale(arg: str, dp: int, max_scale: float | None) -> float:
    """`--time-scale`: a number, or `auto`: this machine measured with the workers of the largest
    case computing at once (shared/config/timescale.py); above 20 it runs all the same, warning once."""
    if arg != "auto":
        return float(arg)
    spec = parse_spec(bench_spec(enabled=True, iterations=1, dp=dp))
    cal = calibrate(spec, max_scale=max_scale)
    print(cal.line(), file=sys.stderr, flush=True)
    if cal.warning:
        print(f"warning: {cal.warning}", file=sys.stderr, flush=True)
    return cal.scale


#: The case the last JSON line always reports: the one the targets are set for.
HEADLINE = (2, "profiled")
#: `--sweep`: these shares of the bubbles' capacity.
SWEEP = (0.5, 0.8, 1.0, 1.2)


def sweep_table(results: list[dict[str, Any]]) -> str:
    """The sweep as a table: one row per offered share."""
    cols = ("offered_share", "bubble_fill_ratio", "slo_attainment", "ttft_p99_device_ms", "train_slowdown_mean_pct")
    rows = [" | ".join(cols), " | ".join("---" for _ in cols)]
    rows += [" | ".join(str(r[c]) for c in cols) for r in results]
    return "\n".join(f"| {row} |" for row in rows)


def sweep_picture(results: list[dict[str, Any]], path: Path) -> None:
    """Fill, TTFT p99, SLO attainment and slowdown against the offered share of capacity, drawn as
    `bubbletea report` draws its pictures (matplotlib, Agg)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    x = [100 * r["offered_share"] for r in results]
    fig = Figure(figsize=(14, 3.2))
    FigureCanvasAgg(fig)
    axes = fig.subplots(1, 4)
    for ax, key, label in zip(
        axes,
        ("bubble_fill_ratio", "ttft_p99_device_ms", "slo_attainment", "train_slowdown_mean_pct"),
        ("fill ratio", "TTFT p99 (device ms)", "SLO attainment (of requests sent)", "training slowdown (%)"),
        strict=True,
    ):
        ax.plot(x, [r[key] if r[key] is not None else float("nan") for r in results], marker="o")
        ax.set_xlabel("offered load (% of bubble capacity)")
        ax.set_title(label, fontsize=10)
        ax.grid(alpha=0.3)
    k = results[0]["time_scale_k"]
    fig.suptitle(f"BubbleTea under open-loop load (time scale k = {k:g}; device clock)", fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="only the headline case (DP=2, profiled), 8 iterations a run")
    ap.add_argument("--dp", type=int, choices=(1, 2), help="only this DP degree (workers = 2 x DP)")
    ap.add_argument("--mode", choices=ALL_MODES, help="only this mode (real: no device profile at all)")
    ap.add_argument("--pairs", type=int, default=3, help="interleaved off/on pairs per case; default 3")
    ap.add_argument("--iterations", type=int, help="training iterations per run; default 8 with --quick, else 16")
    ap.add_argument(
        "--load",
        type=float,
        default=0.8,
        metavar="SHARE",
        help="offered load as a share of the bubbles' capacity (Poisson, open loop); default 0.8",
    )
    ap.add_argument(
        "--sweep",
        action="store_true",
        help=f"run each case at {', '.join(f'{x * 100:.0f}%%' for x in SWEEP)} "
        "of capacity; print a table and write a picture (--out)",
    )
    ap.add_argument(
        "--redis-cluster",
        action="store_true",
        help="run the services on an embedded Redis Cluster (3 masters, 1 replica each) instead of one redis-server",
    )
    ap.add_argument(
        "--dispatch",
        choices=("one", "per_dc"),
        default="one",
        help="bubbletea.dispatch: one dispatcher for the run (the default), or one per datacenter",
    )
    ap.add_argument("--out", default="runs", help="where --sweep writes its picture (default: runs/)")
    ap.add_argument(
        "--dump",
        metavar="DIR",
        help="write each run's spans and dispatcher records (JSONL) into DIR, and every bubble that had work "
        "and stayed empty, with its predicted and actual length (<run>.empty_bubbles.jsonl)",
    )
    ap.add_argument(
        "--job",
        choices=sorted(SIZES),
        help="--mode real only: train and serve the GPU check's Llama job of this size (bench/lib/gpu_job.py) "
        "with Azure-trace prompt lengths, instead of the small GPT and 96-token prompts",
    )
    ap.add_argument(
        "--sim",
        action="store_true",
        help="after each case, simulate its last pair with device times fitted from it (bench/lib/sim_fit.py): "
        "sim_* keys, the simulator's relative error on iteration time, bubble fraction and fill",
    )
    ap.add_argument(
        "--ttft-slo-ms",
        type=float,
        default=1000.0,
        metavar="MS",
        help="the TTFT objective in device ms, and each request's deadline; default 1000",
    )
    ap.add_argument(
        "--max-rate",
        type=float,
        metavar="RPS",
        help="offer at most this many requests per real second, whatever the capacity (the host's own limit: "
        "bench/gpu_check.py, where real compute on a GPU holds more than one machine's front door sends)",
    )
    ap.add_argument("--concurrency", type=int, help=argparse.SUPPRESS)  # the old closed loop's: no longer used
    ap.add_argument(
        "--time-scale",
        default="auto",
        metavar="K",
        help="the device time scale (one profiled ms = K real ms, shared/config/timescale.py): auto (the default) "
        "measures this machine first and picks it; or a number >= 1",
    )
    ap.add_argument("--max-time-scale", type=float, metavar="K", help="refuse a measured scale above K (default: none)")
    ap.add_argument(
        "--priority",
        choices=PRIORITIES,
        default="low",
        help="the workers' torch threads below the event loops (low, the default) or not (normal): "
        "BUBBLETEA_COMPUTE_PRIORITY, shared/runtime/priority.py",
    )
    args = ap.parse_args(argv)
    os.environ["BUBBLETEA_COMPUTE_PRIORITY"] = args.priority  # the services inherit it
    if args.pairs < 1:
        ap.error("--pairs must be at least 1")
    if not 0 < args.load <= 10:
        ap.error("--load must be a share of capacity above 0 (1.0 = all of it)")
    if args.job is not None and args.mode != "real":
        ap.error("--job runs real compute: it needs --mode real (bench/gpu_check.py passes both)")
    if args.concurrency is not None:
        print("note: --concurrency is no longer used: the load is open loop at --load of capacity", file=sys.stderr)
    if args.quick:
        base = [HEADLINE]
    else:
        base = [(dp, mode) for dp in (2, 1) for mode in (ALL_MODES if args.mode == "real" else MODES)]
        base = [c for c in base if (args.dp in (None, c[0])) and (args.mode in (None, c[1]))]
        base.sort(key=lambda c: c == HEADLINE)  # the headline case last
    shares = SWEEP if args.sweep else (args.load,)
    cases = [(dp, mode, share) for dp, mode in base for share in shares]
    iterations = args.iterations or (8 if args.quick else 16)
    scale = time_scale(args.time_scale, max(dp for dp, _ in base), args.max_time_scale)
    os.environ["BUBBLETEA_TIME_SCALE"] = f"{scale:g}"  # the services inherit it
    t0 = time.perf_counter()
    kw = {"pairs": args.pairs, "iterations": iterations, "slo_device_ms": args.ttft_slo_ms, "max_rate": args.max_rate}
    kw["dump"] = Path(args.dump) if args.dump else None
    kw["job"], kw["sim"], kw["redis_cluster"] = args.job, args.sim, args.redis_cluster
    kw["dispatch"] = args.dispatch
    results = uvloop.run(bench(cases, k=scale, **kw))
    for res in results:
        res["redis"] = "embedded cluster, 3 masters + 3 replicas" if args.redis_cluster else "one embedded redis-server"
        res["dispatch"] = args.dispatch
        res["bench_s"] = round(time.perf_counter() - t0, 1)
        res["compute_priority"] = args.priority
        res["device_time_scale"] = scale
        print(f"== dp={res['dp']} mode={res['mode']} load={res['offered_share']:.0%}", file=sys.stderr)
        for k, v in res.items():
            print(f"{k:<32} {v}", file=sys.stderr)
    if args.sweep:
        print(sweep_table(results), file=sys.stderr)
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        picture = out / f"bubble-fill-sweep-{time.strftime('%Y%m%d-%H%M%S')}.png"
        sweep_picture(results, picture)
        print(f"picture: {picture}", file=sys.stderr)
    headline = [r for r in results if (r["dp"], r["mode"]) == HEADLINE and r["offered_share"] == args.load]
    for res in [r for r in results if r not in headline] + headline:
        print(json.dumps(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
