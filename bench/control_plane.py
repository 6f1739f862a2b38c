"""The control plane's capacity (issue 66): Redis and the dispatcher under the event mix the
simulator predicts for 512, 2,048 and 8,192 GPUs, with no compute.

The mix is the simulator's own (`bench/lib/cp_mix.py`: `bench/sim_scale.py`'s case run at load 0.5,
seed 0, at the start of every run): per second, requests, bubble starts and ends, and batch reports,
the inputs `bench/sim_scale.py` counts as `dispatcher_inputs_per_s` (the documented 2,229 / 10,505 /
39,644 at 512 / 2,048 / 8,192 GPUs). A case drives that mix scaled to fewer workers (each worker as
busy with bubbles as in the simulation, requests in proportion) through real processes:

* a real dispatcher process (time scale 1) on the arm's backend;
* emulated stage workers (`bench/lib/cp_workers.py`, several processes): bubbles announced,
  batches read from their fill streams, answered and reported in one pipeline, acked, and each
  slot's lease renewed every second (one EVAL a worker);
* a front door (`bench/lib/cp_front.py`): Poisson requests accepted with the front door's own
  script, and its results stream read as the front door reads its answers;
* the dispatcher's own claims, trims and heartbeats, as it runs. Left out: the data plane's
  rendezvous, recovery (no worker fails), the front door's HTTP (only its Redis traffic).

Arms, side by side (each case runs every arm, one after the other, on a fresh backend):
(a) ``single``: one redis-server; (b) ``cluster``: a Redis Cluster of 3 masters with a replica each
(`shared.runtime.redis_cluster.EmbeddedCluster`), the dispatcher on it; (c) ``cluster-per-dc``: the
same cluster and a dispatcher per datacenter (`bubbletea.dispatch: per_dc`: 4 dispatchers, each
worker sending to its datacenter's; the front door puts the requests on the datacenters' streams in
turn, not routed on their snapshots). With one dispatcher a run's keys carry its hash tag, so the
run lives on one master and the others show what they spend idle; with a dispatcher per datacenter
each datacenter's keys carry a tag of their own (`{<run>:<dc>}`), so the run's load spreads over
the masters those tags hash to (the per-node CPU is reported as it is). Where the cluster backend
is not importable, arms (b) and (c)
are left out and the JSON says why. The dispatcher's figures are all its processes together (CPU a
input, to compare with one's; ``per_dc_cost``: per case, and from the marginal cost) and the
busiest one's share of a core.

Figures per case (host clock, real time), over a measured window after start-up and warm-up:
inputs a second offered and measured (by kind; requests by XINFO entries-added), the
**CPU microseconds per input** of the dispatcher and of every Redis server process (read by PID
from /proc), Redis commands per input and `used_memory` per node at the end, the dispatcher's
**decision p50/p99** (its heartbeat's `decision_ms_*`, over its last 10,000 flushes), the
**bubble-start-to-work p50/p99** (a worker's bubble start announced to the first batch arriving at it
before its next bubble that holds a request accepted before that start: work that was waiting for
the bubble; a request that arrives mid-bubble and goes out at once is not the dispatcher answering a
bubble. The share of bubbles so measured: ``bubbles_with_work_share``), and the
CPU of the emulator and front door (they share the machine). A case is **held** when its measured
inputs reach 90% of those offered and its decision p99 is under 2 ms.

The sweep: each mix at 32 workers (quick; 64 in full), then the 8,192-GPU mix at more workers
until no arm holds. Headlines per arm: the largest input rate held, and from its per-input costs the
dispatcher cores and Redis shards (masters) the 8,192- and 65,536-GPU jobs need at 0.7 core a
process (65,536: the 8,192 mix scaled linearly by GPUs, x8), assuming the load spreads evenly over
shards and dispatchers (a hash tag and a dispatcher per datacenter: not built); ``*_marginal``: the
same from a line fitted to each process's CPU against the inputs over the 8,192-GPU mix's held
cases (the fixed part, timers and polls, counted once, not per input). Last line: one JSON object.

    python bench/control_plane.py --quick        # about 2-3 minutes with both arms
    python bench/control_plane.py                # 10 s a case, the sweep up to the whole 8,192 job
    python bench/control_plane.py --gpus 8192 --workers 128 --seconds 5 --arms single   # one case
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the checkout: bench.lib

import uvloop

from bench.lib.cp_case import Backend, Node, run_case
from bench.lib.cp_figures import CORE_BUDGET, DECISION_P99_MS, marginal, sizing
from bench.lib.cp_mix import DOCUMENTED_INPUTS_PER_S, PP, Mix, from_simulator
from bench.lib.output import emit, stderr
from shared.runtime.redis_cluster import EmbeddedCluster
from shared.runtime.redis_server import EmbeddedRedis

ARMS = ("single", "cluster", "cluster-per-dc")
#: The issue's bound on what a dispatcher per datacenter may add to the dispatching CPU a input.
PER_DC_COST_BOUND = 1.10
SIZES = (512, 2_048, 8_192)
QUICK_SWEEP = (64, 128, 192, 256)
FULL_SWEEP = (128, 192, 256, 384, 512, 768, 1024)
SCALE_TO = 65_536


def start_backend(arm: str) -> Backend:
    if arm == "single":
        redis = EmbeddedRedis().start()
        assert redis.proc is not None
        return Backend(redis.url, [Node("master", redis.proc.pid, redis.port)], redis.stop)
    cluster = EmbeddedCluster(masters=3, replicas=1).start()
    nodes = [Node(n.role, n.pid, n.port) for n in cluster.nodes() if n.pid]
    return Backend(cluster.url, nodes, cluster.stop)


async def one_case(arm: str, mix: Mix, seconds: float, workdir: Path) -> dict[str, Any]:
    backend = await asyncio.to_thread(start_backend, arm)
    try:
        row = await run_case(backend, arm, mix, seconds, workdir)
    finally:
        await asyncio.to_thread(backend.stop)
    load = ", ".join(f"{n['role'][0]}:{n['port']} {n['cpu']:.2f}" for n in row["redis_nodes"])
    stderr(
        f"{arm:>7} {mix.gpus:>5}-GPU mix, {mix.workers:>4} workers: {row['measured']['inputs_per_s']:>8.1f} of "
        f"{row['offered']['inputs_per_s']:.1f} inputs/s; dispatcher {row['dispatcher']['cpu']:.2f} core "
        f"({row['dispatcher']['cpu_us_per_input']} us/input), redis [{load}] core; decision p99 "
        f"{row['decision_p99_ms']} ms, bubble start to work p99 {row['bubble_start_to_work_p99_ms']} ms; "
        f"emulator {row['emulator_cpu']:.2f} core; {'held' if row['held'] else 'NOT held'}"
    )
    return row


async def bench(
    mixes: dict[int, Mix], cases: list[tuple[int, int]], sweep: list[int], arms: list[str], seconds: float
) -> tuple[list[dict[str, Any]], dict[str, str]]:
    """Every fixed case on every arm, then the 8,192-GPU mix at each of `sweep`'s worker counts
    until no arm holds (a machine that cannot drive one will not drive the next). An arm other than
    ``single`` whose case fails (its backend or the dispatcher on it) is left out from there on, with
    why: the cases, and `single`, go on."""
    rows: list[dict[str, Any]] = []
    failed: dict[str, str] = {}

    async def each(gpus: int, workers: int, tmp: Path) -> list[dict[str, Any]]:
        out = []
        for arm in [a for a in arms if a not in failed]:
            try:
                out.append(await one_case(arm, mixes[gpus].scaled(workers), seconds, tmp))
            except Exception as exc:
                if arm == "single":
                    raise
                failed[arm] = f"failed at the {gpus}-GPU mix, {workers} workers: {exc!r}"
                stderr(f"arm {arm} left out: {failed[arm]}")
        return out

    with tempfile.TemporaryDirectory() as tmp:
        for gpus, workers in cases:
            rows += await each(gpus, workers, Path(tmp))
        for workers in sweep:
            held = await each(SIZES[-1], workers, Path(tmp))
            rows += held
            if not any(r["held"] for r in held):
                break
    return rows, failed


def headline(rows: list[dict[str, Any]], arm: str, big: float) -> dict[str, Any]:
    """An arm's largest input rate held, and the sizing of the 8,192-GPU job (`big` inputs a second)
    and of 65,536 GPUs from that case's costs a input (or, where no case held, from the case that
    drove the most: said in ``costs_from``)."""
    mine = [r for r in rows if r["arm"] == arm]
    held = [r for r in mine if r["held"]]
    # held cases only: where the dispatcher fell behind, it was short of a core, not cheaper
    swept = [r for r in mine if r["held"] and r["mix_gpus"] == SIZES[-1]]
    best = max(held or mine, key=lambda r: r["measured"]["inputs_per_s"], default=None)
    if best is None:
        return {}
    return {
        "largest_inputs_per_s_held": best["measured"]["inputs_per_s"] if held else None,
        "costs_from": f"{best['mix_gpus']}-GPU mix, {best['workers']} workers" + ("" if held else " (not held)"),
        "dispatcher_cpu_us_per_input": best["dispatcher"]["cpu_us_per_input"],
        "redis_cpu_us_per_input": [n["cpu_us_per_input"] for n in best["redis_nodes"]],
        "decision_p99_ms": best["decision_p99_ms"],
        "bubble_start_to_work_p99_ms": best["bubble_start_to_work_p99_ms"],
        "redis_used_memory_bytes": [n["used_memory_bytes"] for n in best["redis_nodes"]],
        "sizing_8192": sizing(best, big),
        f"sizing_{SCALE_TO}": sizing(best, big * SCALE_TO / SIZES[-1]),
        # the same from the marginal cost over the 8,192-GPU mix's held cases (a fixed part apart)
        "sizing_8192_marginal": marginal(swept, big),
        f"sizing_{SCALE_TO}_marginal": marginal(swept, big * SCALE_TO / SIZES[-1]),
    }


def _arms(text: str) -> list[str]:
    arms = [a for a in text.split(",") if a]
    if not arms or any(a not in ARMS for a in arms):
        raise argparse.ArgumentTypeError(f"arms are {', '.join(ARMS)} (comma-separated), got {text!r}")
    return arms


def parse(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="5 s a case; each mix at 32 workers, the sweep to 256")
    ap.add_argument("--seconds", type=float, help="measured seconds a case (default 10, --quick 5)")
    ap.add_argument("--arms", type=_arms, default=list(ARMS), help="single,cluster,cluster-per-dc (default all)")
    ap.add_argument("--gpus", type=int, choices=SIZES, help="one case only: this job's mix (with --workers)")
    ap.add_argument("--workers", type=int, metavar="N", help=f"one case only: N emulated workers (a multiple of {PP})")
    args = ap.parse_args(argv)
    if (args.gpus is None) != (args.workers is None):
        ap.error("--gpus and --workers go together (one case)")
    if args.workers is not None and (args.workers < PP or args.workers % PP):
        ap.error(f"--workers must be a positive multiple of {PP} (whole pipeline replicas)")
    if args.seconds is not None and args.seconds <= 0:
        ap.error("--seconds must be above 0")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    arms = list(args.arms)
    mixes = {g: from_simulator(g) for g in ([args.gpus] if args.gpus else SIZES)}
    for m in mixes.values():
        stderr(f"{m.gpus}-GPU mix: {m.inputs_per_s:,.0f} inputs/s on {m.workers} workers ({m.source})")
    if args.gpus:
        cases, sweep = [(args.gpus, args.workers)], []
    else:
        each = 32 if args.quick else 64
        cases, sweep = [(g, each) for g in SIZES], list(QUICK_SWEEP if args.quick else FULL_SWEEP)
    seconds = args.seconds or (5.0 if args.quick else 10.0)
    rows, failed = uvloop.run(bench(mixes, cases, sweep, arms, seconds))
    skipped = failed
    arms = [a for a in arms if a not in failed]
    big = round(mixes[SIZES[-1]].inputs_per_s if SIZES[-1] in mixes else DOCUMENTED_INPUTS_PER_S[SIZES[-1]], 1)
    out: dict[str, Any] = {
        "bench": "control_plane",
        "clock": "host (real) time; the dispatcher at time scale 1",
        "seconds": seconds,
        "arms": arms,
        "arms_left_out": skipped,
        "left_out_traffic": "the data plane's rendezvous, recovery, the front door's HTTP",
        "mixes": {
            str(g): m.figures() | {"documented_inputs_per_s": DOCUMENTED_INPUTS_PER_S.get(g)} for g, m in mixes.items()
        },
        "core_budget": CORE_BUDGET,
        "scaled_to": f"{SCALE_TO:,} GPUs: the 8,192-GPU mix x{SCALE_TO // SIZES[-1]} (linear in GPUs)",
        # one case of a smaller mix does not simulate the 8,192-GPU job: its documented figure sizes it
        "sizing_inputs_per_s": big,
        "sizing_inputs_from": "simulated this run" if SIZES[-1] in mixes else "documented (docs/simulator.md)",
        "headline": {arm: headline(rows, arm, big) for arm in arms},
        "cases": rows,
    }
    out["per_dc_cost"] = per_dc_cost(rows)
    out["targets"] = {
        f"decision_p99_ms < {DECISION_P99_MS:g} at the largest rate driven, {arm}": _largest_ok(rows, arm)
        for arm in arms
    }
    ratio = out["per_dc_cost"].get("marginal_ratio")
    out["targets"]["dispatcher CPU per input, per DC within 10% of one's (marginal)"] = (
        None if ratio is None else ratio <= PER_DC_COST_BOUND
    )
    emit(out)
    return 0


def per_dc_cost(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """A dispatcher per datacenter against one, on the same cluster: the dispatchers' CPU a input,
    all of them together over one's, per case both arms ran (held or not: each its cost), and the
    same from the marginal cost over the 8,192-GPU mix's held cases (each dispatcher's timer and
    polls are a fixed part, counted per process, not per input)."""
    one = {(r["mix_gpus"], r["workers"]): r for r in rows if r["arm"] == "cluster"}
    cases = []
    for r in rows:
        base = one.get((r["mix_gpus"], r["workers"]))
        if r["arm"] != "cluster-per-dc" or base is None:
            continue
        a, b = base["dispatcher"]["cpu_us_per_input"], r["dispatcher"]["cpu_us_per_input"]
        cases.append(
            {
                "mix_gpus": r["mix_gpus"],
                "workers": r["workers"],
                "one_us": a,
                "per_dc_us": b,
                "ratio": round(b / a, 3) if a and b else None,
                "per_dc_busiest_cpu": r["dispatcher"]["busiest_cpu"],
            }
        )
    swept = {
        arm: marginal([r for r in rows if r["arm"] == arm and r["held"] and r["mix_gpus"] == SIZES[-1]], 0.0)
        for arm in ("cluster", "cluster-per-dc")
    }
    slopes = [swept[a].get("dispatcher_us_per_input") for a in ("cluster", "cluster-per-dc")]
    ratio = round(slopes[1] / slopes[0], 3) if all(slopes) and slopes[0] > 0 else None
    return {"cases": cases, "marginal_us_per_input": slopes, "marginal_ratio": ratio}


def _largest_ok(rows: list[dict[str, Any]], arm: str) -> bool | None:
    driven = [r for r in rows if r["arm"] == arm and r["driven"]]
    if not driven:
        return None
    top = max(driven, key=lambda r: r["measured"]["inputs_per_s"])
    return top["decision_p99_ms"] is not None and top["decision_p99_ms"] < DECISION_P99_MS


if __name__ == "__main__":
    sys.exit(main())
