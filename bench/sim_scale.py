"""The simulator at scale: BubbleTea's figures against the offered load at 512, 2,048 and 8,192
GPUs, and how fast the simulator runs them.

Each case is 4 datacenters of G/4 GPUs, TP=8, PP=16 (4 consecutive stages per DC, 3 WAN hops),
DP = G/128, so G/8 pipeline slots; a 64-layer model with a device profile, 16 microbatches of one
2k-token sequence, a 400 Gb/s, 20 ms WAN with 64 connections per transfer; a 32-layer served model
whose prefill block (one layer of one prompt) counts 0.5 ms + 4 us per token, Poisson requests of
~512-token prompts (256-768) at a **load**: a share of what the bubbles could hold
(`sim.run.capacity_rate`: the bubble time the fit rule can fill, over a mean prompt's cost).

The sweep simulates BubbleTea off once per scale, then on at each load (0.5, 0.8, 1.0, 1.2 by
default) for each seed; a point's figures are the medians over the seeds:

* `utilization`: training and prefill time over the steady window (`runstats.utilization`);
* `useful_utilization` (**the headline**): the same with only the prefill time that computed prompt
  tokens, the blocks' fixed parts (and first-token reads) apart;
* `fill` and `useful_fill`: of the bubble time, the prefill (and the useful prefill) in it;
* `slowdown_pct`: the steady iteration time with BubbleTea on over off (the steady mean: the
  median of the iterations after the first);
* `overrun_p50_ms`, `overrun_p99_ms`: per bubble that ran prefill, training's wait past its input;
* `tokens_per_gpu_s`: prompt tokens answered per GPU-second (simulated);
* `s_per_iter` and `cpu_s_per_iter`: the host's wall and CPU seconds per simulated iteration of
  the on run (the machine is shared: wall time includes waiting for a core).

The clock of every figure but the last two is the simulated device's. The sweep is drawn (`--picture`,
default docs/sim-scale-sweep.png): utilization (both) and slowdown against load, per scale.
Last line: one JSON object. Targets (issue 63): at load 1.0-1.2, useful utilization >= 0.94 and
slowdown < 0.5% at every scale; at 0.8 slowdown < 0.5%; one 8,192-GPU iteration in under 1 s.

    python bench/sim_scale.py                 # 512, 2,048, 8,192 GPUs; loads 0.5-1.2; seeds 0-2
    python bench/sim_scale.py --quick         # 512 and 2,048 GPUs, loads 0.8 and 1.2, one seed
    python bench/sim_scale.py --gpus 8192 --loads 1.0 --seeds 0   # one point (the speed figure)
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from shared.config.spec import ClusterSpec, parse_spec
from sim.dispatchers import DispatchMode
from sim.output import figures
from sim.run import RunResult, SimOptions, SimResult, run_off, simulate_on
from sim.setup import build

INPUT_LEN = 512
LOADS = (0.5, 0.8, 1.0, 1.2)
SIZES = (512, 2048, 8192)
SEEDS = (0, 1, 2)
ITERATIONS = 3
PICTURE = Path(__file__).resolve().parents[1] / "docs" / "sim-scale-sweep.png"
#: a point's figures (medians over its seeds)
FIGURES = (
    "utilization",
    "useful_utilization",
    "fill",
    "useful_fill",
    "slowdown_pct",
    "overrun_p50_ms",
    "overrun_p99_ms",
    "tokens_per_gpu_s",
    "request_rate",
    "requests_sent",
    "requests_served",
    "s_per_iter",
    "cpu_s_per_iter",
    "ttft_p50_ms",
    "ttft_p99_ms",
)


def scale_spec(gpus: int, fixed_ms: float = 0.5, objective_ms: float | None = None) -> ClusterSpec:
    dp = gpus // (16 * 8)
    raw: dict[str, Any] = {
        "name": f"scale-{gpus}",
        "datacenters": [{"name": f"dc-{i}", "gpus": gpus // 4} for i in range(4)],
        "wan": {
            "sharing": "temporal",
            "default": {"latency_ms": 20.0, "bandwidth_gbps": 400.0, "tcp_window_mib": 6.0, "connections": 64},
        },
        "model": {"layers": 64, "d_model": 4096, "heads": 32, "seq_len": 2048, "vocab": 32000},
        "parallelism": {"pp": 16, "dp": dp, "tp": 8},
        "training": {"schedule": "1f1b", "microbatches": 16, "microbatch_size": 1, "iterations": ITERATIONS},
        "device": {
            "fwd_ms_per_layer": 2.0,
            "bwd_ms_per_layer": 4.0,
            "allreduce_ms": 100.0,
            "step_ms": 10.0,
            "memory_gib": 80,
            "prefill_ms_per_layer": fixed_ms,
            "prefill_us_per_token": 4.0,
        },
        "bubbletea": {"max_batch_requests": 32},
        "prefill": {
            "model": {"layers": 32, "d_model": 4096, "heads": 32, "seq_len": 4096, "vocab": 32000},
            "max_prompt_tokens": 2048,
            **({"ttft_objective_ms": objective_ms} if objective_ms is not None else {}),
        },
    }
    return parse_spec(raw, source=f"scale-{gpus}")


def dispatcher_inputs(on: RunResult) -> int:
    """Every message the dispatcher takes in a simulated run: requests, two per bubble, a report per batch."""
    s = on.serving
    assert s is not None, "a run with BubbleTea on"
    bubbles = sum(1 for sp in on.spans if sp.kind == "wait")
    return s.sent + 2 * bubbles + s.batches


def one_run(result: SimResult, iterations: int) -> dict[str, Any]:
    """The figures of one BubbleTea-on run (one seed)."""
    f, on = figures(result), result.on
    assert on is not None
    return {
        "utilization": f["utilization_on"],
        "useful_utilization": f["useful_utilization_on"],
        "fill": f["fill_ratio"],
        "useful_fill": f["useful_fill_ratio"],
        "slowdown_pct": f["train_slowdown_pct"],
        "overrun_p50_ms": f["overrun_p50_ms"] or 0.0,
        "overrun_p99_ms": f["overrun_p99_ms"] or 0.0,
        "tokens_per_gpu_s": f["prefill_tokens_per_gpu_s"],
        "request_rate": f["request_rate"],  # per simulated second: `load` x the capacity
        "requests_sent": f["requests_sent"],
        "requests_served": f["requests_served"],
        "ttft_p50_ms": f["ttft_p50_ms"] or 0.0,
        "ttft_p99_ms": f["ttft_p99_ms"] or 0.0,
        "slo_attainment": f["slo_attainment"],  # answered within the objective, of those sent (None: none)
        "requests_failed": f["requests_failed"],  # by reason
        "requests_routed": f["requests_routed"],  # per DC dispatch: by `dc_routing.RouteWhy`
        "requests_served_by_dc": f["requests_served_by_dc"],
        "events": on.events,
        # what one dispatcher would take in a second of this job (requests, bubble starts and ends,
        # batch reports), against bench/dispatcher.py's inputs per core-second
        "dispatcher_inputs_per_s": round(dispatcher_inputs(on) / on.makespan) if on.makespan > 0 else None,
        "s_per_iter": round(on.wall_s / iterations, 3),
        "cpu_s_per_iter": round(on.cpu_s / iterations, 3),
    }


def sweep_scale(
    gpus: int,
    loads: list[float],
    seeds: list[int],
    iterations: int,
    fixed_ms: float,
    dispatch: tuple[DispatchMode, ...] = (DispatchMode.ONE,),
    objective_ms: float | None = None,
    snapshot_every_ms: float | None = None,
) -> dict[str, Any]:
    """One scale: BubbleTea off once, then on at every load, dispatch mode and seed; a point per load
    and mode (medians)."""
    setup = build(scale_spec(gpus, fixed_ms, objective_ms))
    off = run_off(setup, iterations)
    base = figures(SimResult(setup, SimOptions(iterations=iterations), off, None, None))
    points = []
    for load, mode in itertools.product(loads, dispatch):
        runs = []
        for seed in seeds:
            every = None if snapshot_every_ms is None else snapshot_every_ms / 1000
            options = SimOptions(
                iterations=iterations, input_len=INPUT_LEN, load=load, seed=seed, dispatch=mode, snapshot_every_s=every
            )
            runs.append(one_run(simulate_on(setup, off, options), iterations))
        point = {"load": load, "dispatch": mode.value, **{k: _median([r[k] for r in runs]) for k in FIGURES}}
        attained = [r["slo_attainment"] for r in runs if r["slo_attainment"] is not None]
        point["slo_attainment"] = _median(attained) if attained else None
        point["runs"] = runs
        points.append(point)
        slo = "" if point["slo_attainment"] is None else f", SLO {point['slo_attainment']:.3f} of sent"
        print(
            f"{gpus:>5} GPUs, load {load:.1f}, dispatch {mode.value}: TTFT p50 {point['ttft_p50_ms']:.1f} ms p99 "
            f"{point['ttft_p99_ms']:.1f} ms{slo}; utilization {point['utilization']:.3f} (useful "
            f"{point['useful_utilization']:.3f}), fill {point['fill']:.3f} (useful {point['useful_fill']:.3f}), "
            f"slowdown {point['slowdown_pct']:+.2f}%, overrun p50 {point['overrun_p50_ms']:.2f} ms p99 "
            f"{point['overrun_p99_ms']:.2f} ms, {point['tokens_per_gpu_s']:.0f} prompt tokens/GPU-s; "
            f"{point['s_per_iter']:.2f} s per simulated iteration ({point['cpu_s_per_iter']:.2f} s CPU), "
            f"{len(seeds)} seed(s)",
            flush=True,
        )
    return {
        "gpus": gpus,
        "slots": base["slots"],
        "iteration_ms_off": base["iteration_ms_off"],
        "bubble_fraction": base["bubble_fraction"],
        "utilization_off": base["utilization_off"],
        "events_off": off.events,
        "s_per_iter_off": round(off.wall_s / iterations, 3),
        "points": points,
    }


def targets(scales: list[dict[str, Any]]) -> dict[str, Any]:
    """Issue 63's targets, judged on the medians (None: no point to judge)."""
    high = [p for s in scales for p in s["points"] if p["load"] >= 1.0]
    mid = [p for s in scales for p in s["points"] if p["load"] == 0.8]
    speed = [p["s_per_iter"] for s in scales if s["gpus"] == 8192 for p in s["points"]]
    return {
        "useful_utilization_ge_0_94_at_load_1_to_1_2": all(p["useful_utilization"] >= 0.94 for p in high)
        if high
        else None,
        "slowdown_lt_0_5_pct_at_load_1_to_1_2": all(p["slowdown_pct"] < 0.5 for p in high) if high else None,
        "slowdown_lt_0_5_pct_at_load_0_8": all(p["slowdown_pct"] < 0.5 for p in mid) if mid else None,
        "s_per_iter_8192_lt_1": (max(speed) < 1.0) if speed else None,
    }


def picture(scales: list[dict[str, Any]], path: Path) -> Path:
    """Utilization (all of it, and the useful) and the training slowdown against load, per scale."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (util, slow) = plt.subplots(1, 2, figsize=(10, 4))
    for s in scales:
        mode = s["points"][0]["dispatch"]  # one line per scale: the first dispatch mode's
        s = {**s, "points": [p for p in s["points"] if p["dispatch"] == mode]}
        loads = [p["load"] for p in s["points"]]
        line = util.plot(loads, [p["utilization"] for p in s["points"]], "o-", label=f"{s['gpus']:,} GPUs")
        util.plot(
            loads,
            [p["useful_utilization"] for p in s["points"]],
            "s--",
            color=line[0].get_color(),
            label=f"{s['gpus']:,} GPUs, useful",
        )
        slow.plot(loads, [p["slowdown_pct"] for p in s["points"]], "o-", label=f"{s['gpus']:,} GPUs")
    off = scales[0]["utilization_off"]
    util.axhline(off, color="grey", linestyle=":", label="BubbleTea off")
    util.axhline(0.94, color="black", linestyle="-.", linewidth=0.8, label="the papers' 94%")
    util.set_xlabel("offered load (share of what the bubbles could hold)")
    util.set_ylabel("GPU utilization (steady window)")
    util.set_ylim(0, 1.02)
    util.legend(fontsize=7, loc="lower right")
    slow.axhline(0.5, color="black", linestyle="-.", linewidth=0.8, label="target: 0.5%")
    slow.set_xlabel("offered load")
    slow.set_ylabel("training slowdown (%, steady iteration)")
    slow.legend(fontsize=7)
    fig.suptitle("The simulator at scale: BubbleTea with the fit rule (medians over seeds)", fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _median(values: list[Any]) -> Any:
    return round(statistics.median(values), 4)


def _floats(text: str) -> list[float]:
    return [float(v) for v in text.split(",") if v]


def _ints(text: str) -> list[int]:
    return [int(v) for v in text.split(",") if v]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="512 and 2,048 GPUs, loads 0.8 and 1.2, seed 0")
    ap.add_argument("--gpus", type=_ints, default=None, help="the scales, comma-separated (default 512,2048,8192)")
    ap.add_argument("--loads", type=_floats, default=None, help="the loads, comma-separated (default 0.5,0.8,1.0,1.2)")
    ap.add_argument("--seeds", type=_ints, default=None, help="the seeds, comma-separated (default 0,1,2)")
    ap.add_argument("--iterations", type=int, default=ITERATIONS, help="simulated iterations per run (default 3)")
    ap.add_argument("--fixed-ms", type=float, default=0.5, help="a prefill block's fixed part, ms (default 0.5)")
    ap.add_argument(
        "--dispatch",
        default="one",
        help="one dispatcher, a dispatcher per datacenter, or both: one, per-dc or one,per-dc (default one)",
    )
    ap.add_argument("--ttft-objective-ms", type=float, default=None, help="the requests' TTFT objective (default none)")
    ap.add_argument(
        "--snapshot-every-ms",
        type=float,
        default=None,
        help="per DC: how often the dispatchers publish their snapshots and the front door reads them "
        "(default: the live readiness interval, 250 ms)",
    )
    ap.add_argument(
        "--picture",
        type=Path,
        default=None,
        help=f"where to draw the sweep (default {PICTURE}; --quick: none unless given)",
    )
    args = ap.parse_args(argv)
    sizes = args.gpus or ([512, 2048] if args.quick else list(SIZES))
    loads = args.loads or ([0.8, 1.2] if args.quick else list(LOADS))
    seeds = args.seeds or ([0] if args.quick else list(SEEDS))
    t0 = time.perf_counter()
    modes = tuple(DispatchMode(m.strip().replace("-", "_")) for m in args.dispatch.split(",") if m.strip())
    scales = [
        sweep_scale(
            g, loads, seeds, args.iterations, args.fixed_ms, modes, args.ttft_objective_ms, args.snapshot_every_ms
        )
        for g in sizes
    ]
    out: dict[str, Any] = {
        "bench": "sim_scale",
        "clock": "simulated device (figures); host wall and CPU (s_per_iter, cpu_s_per_iter)",
        "prefill_block": f"{args.fixed_ms:g} ms + 4 us per token, whole layers",
        "input_len": INPUT_LEN,
        "iterations": args.iterations,
        "seeds": seeds,
        "loads": loads,
        "dispatch": [m.value for m in modes],
        "ttft_objective_ms": args.ttft_objective_ms,
        "snapshot_every_ms": args.snapshot_every_ms,
    }
    out.update({f"s_per_iter_{s['gpus']}": max(p["s_per_iter"] for p in s["points"]) for s in scales})
    out.update({f"cpu_s_per_iter_{s['gpus']}": max(p["cpu_s_per_iter"] for p in s["points"]) for s in scales})
    out["targets"] = targets(scales)
    path = args.picture or (None if args.quick else PICTURE)
    if path is not None:
        out["picture"] = str(picture(scales, path))
    out["wall_s"] = round(time.perf_counter() - t0, 1)
    out["scales"] = scales
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
