"""The papers side by side: baselines, each Atlas step (placement too) and BubbleTea, simulated (docs/paper.md).

Every iteration time and utilization comes from the project's simulator (`sim.run.simulate`, the
shared policies on a virtual clock) run on configs/paper-*.yaml or on variants of them built here
(WAN bandwidth, latency, scale). The one baseline the simulator cannot express, data parallelism
across datacenters, is the simulated in-DC pipeline plus an analytic ring all-reduce of the whole
model's gradients over the WAN (`wan_allreduce_s`, written out in docs/paper.md).

Prints the table (the 5 Gb/s, 40 ms case), then the sweeps, writes the pictures to docs/paper/
(--quick: to runs/paper-quick/) and ends with one JSON line: speedups and utilizations by name.

    python bench/paper.py            # every sweep point, scale up to 4,096 GPUs (under a minute)
    python bench/paper.py --quick    # fewer points, scale up to 512 GPUs

The cases it compares, simulated, and the DP-across-DCs baseline are in bench/_paper_cases.py; here
are the table, the sweeps and the pictures of docs/paper.md, in that page's order.
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from shared.figures.training import speedup
from shared.policies.pipeline_plan import placement_of
from shared.policies.schedules import compute_bubble_fraction

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench._paper_cases import (  # noqa: E402
    Case,
    dp_cases,
    load_raw,
    param_count,
    pp_case,
    spec_of,
    wan_allreduce_s,
    with_wan,
)

CONFIGS = {
    "a": ROOT / "configs" / "paper-pp-1conn-fair.yaml",
    "b": ROOT / "configs" / "paper-pp-fair.yaml",
    "c": ROOT / "configs" / "paper-atlas.yaml",
    # (c) with the naive placement (stages dealt round-robin over the DCs) instead of Atlas's
    "rr": ROOT / "configs" / "paper-round-robin.yaml",
}
PICTURES = ROOT / "docs" / "paper"
QUICK_PICTURES = ROOT / "runs" / "paper-quick"
DPI = 100
#: Scale sweep: sequences per iteration kept fixed while DP grows (microbatches = this / DP).
GLOBAL_BATCH = 256
#: Scale sweep: WAN capacity per DC pair per 4 DP replicas (the base case's 5 Gb/s at DP=4).
SCALE_GBPS_PER_4_REPLICAS = 5.0
#: PipeFill's scale, for the compute-only bubble formula only (not simulated).
PIPEFILL_GPUS = 8192


@dataclass(frozen=True)
class Sweeps:
    """The sweeps' points: WAN bandwidths (Gb/s, at 40 ms), latencies (ms, at 5 Gb/s), DP degrees."""

    bandwidths: tuple[float, ...]
    latencies: tuple[float, ...]
    dps: tuple[int, ...]


FULL = Sweeps((1.4, 2.5, 5.0, 10.0, 20.0, 40.0, 100.0, 400.0), (10.0, 30.0, 50.0, 75.0, 100.0), (4, 8, 16, 32, 64))
QUICK = Sweeps((1.4, 5.0, 20.0), (10.0, 40.0, 100.0), (4, 8))


# --- the table ---------------------------------------------------------------------------------------


def wan_hops(raw: dict[str, Any]) -> int:
    """Pipeline hops that cross the WAN under the spec's placement."""
    return len(placement_of(spec_of(raw)).hops())


def table_cases(raws: dict[str, dict[str, Any]], iterations: int) -> list[Case]:
    ideal, dp, dp_overlap = dp_cases(raws["c"], iterations)
    hops_atlas, hops_rr = wan_hops(raws["c"]), wan_hops(raws["rr"])
    return [
        dp,
        dp_overlap,
        pp_case("pp_1conn_fair", "(a) PP across DCs, 1 TCP connection, fair sharing", raws["a"], iterations),
        pp_case("pp_fair", "(b) (a) + 16 connections per transfer", raws["b"], iterations),
        pp_case("atlas", f"(c) (b) + temporal sharing = Atlas ({hops_atlas} WAN hops)", raws["c"], iterations),
        pp_case(
            "naive_placement", f"(c) with naive placement (round-robin, {hops_rr} WAN hops)", raws["rr"], iterations
        ),
        pp_case("atlas_bubbletea", "(c) + BubbleTea (prefill in the bubbles)", raws["c"], iterations, bubbletea=True),
        ideal,
    ]


def print_table(cases: list[Case]) -> None:
    by = {c.name: c for c in cases}
    dp, base = by["dp_overlap"], by["pp_1conn_fair"]
    print(f"{'configuration':<52} {'iter s':>8} {'vs DP':>7} {'vs (a)':>7} {'util':>6} {'util+BT':>8} {'bubbles':>8}")
    for c in cases:
        on = "" if c.utilization_on is None else f"{c.utilization_on:.1%}"
        bub = "" if c.bubble_fraction is None else f"{c.bubble_fraction:.1%}"
        print(
            f"{c.label:<52} {c.iteration_s:8.2f} {speedup(dp.iteration_s, c.iteration_s):6.2f}x "
            f"{speedup(base.iteration_s, c.iteration_s):6.2f}x {c.utilization:6.1%} {on:>8} {bub:>8}"
        )
    bt, atlas, naive = by["atlas_bubbletea"], by["atlas"], by["naive_placement"]
    print(
        f"  'vs DP' is against the overlapped DP row (the kinder baseline); BubbleTea's training slowdown "
        f"{bt.slowdown_pct:+.2f}%\n"
        f"  placement: Atlas's is {speedup(naive.iteration_s, atlas.iteration_s):.2f}x faster than the naive one "
        "(same WAN, sharing and connections)",
        flush=True,
    )


# --- sweeps --------------------------------------------------------------------------------------------


def sweep_point(raws: dict[str, dict[str, Any]], iterations: int) -> dict[str, float]:
    """Atlas (+BubbleTea), baseline (a) and DP across DCs on one WAN setting."""
    _, _, dp_overlap = dp_cases(raws["c"], iterations)
    a = pp_case("a", "", raws["a"], iterations)
    c = pp_case("c", "", raws["c"], iterations, bubbletea=True)
    assert c.utilization_on is not None and c.bubble_fraction is not None
    return {
        "speedup_vs_a": speedup(a.iteration_s, c.iteration_s),
        "speedup_vs_dp": speedup(dp_overlap.iteration_s, c.iteration_s),
        "util_a": a.utilization,
        "util_dp": dp_overlap.utilization,
        "util_atlas": c.utilization,
        "util_atlas_bt": c.utilization_on,
        "bubbles_atlas": c.bubble_fraction,
        "iteration_s": c.iteration_s,
    }


def wan_sweep(
    raws: dict[str, dict[str, Any]], iterations: int, key: str, values: list[float]
) -> list[dict[str, float]]:
    rows = []
    for v in values:
        t = time.perf_counter()
        row = sweep_point({k: with_wan(r, **{key: v}) for k, r in raws.items()}, iterations)
        row[key] = v
        rows.append(row)
        print(
            f"  {key}={v:g}: Atlas {row['iteration_s']:.2f} s/iteration, speedup {row['speedup_vs_a']:.2f}x vs (a), "
            f"{row['speedup_vs_dp']:.2f}x vs DP; utilization (a) {row['util_a']:.1%}, Atlas {row['util_atlas']:.1%}, "
            f"+BubbleTea {row['util_atlas_bt']:.1%} ({time.perf_counter() - t:.0f} s)",
            flush=True,
        )
    return rows


def scaled(raw: dict[str, Any], dp: int) -> dict[str, Any]:
    """The base job at DP=dp: DC sizes hold 4, 2 and 2 stages of dp x TP GPUs, microbatches =
    GLOBAL_BATCH / dp, WAN capacity SCALE_GBPS_PER_4_REPLICAS x dp / 4 per DC pair."""
    out = copy.deepcopy(raw)
    tp = out["parallelism"]["tp"]
    out["parallelism"]["dp"] = dp
    out["datacenters"] = [
        {"name": "us-east", "gpus": 4 * dp * tp},
        {"name": "us-west", "gpus": 2 * dp * tp},
        {"name": "eu-west", "gpus": 2 * dp * tp},
    ]
    out["training"]["microbatches"] = GLOBAL_BATCH // dp
    out["wan"]["default"]["bandwidth_gbps"] = SCALE_GBPS_PER_4_REPLICAS * dp / 4
    return out


def scale_sweep(raws: dict[str, dict[str, Any]], iterations: int, dps: list[int]) -> list[dict[str, float]]:
    rows = []
    for dp in dps:
        t = time.perf_counter()
        row = sweep_point({k: scaled(r, dp) for k, r in raws.items()}, iterations)
        spec = spec_of(scaled(raws["c"], dp))
        row["gpus"] = spec.parallelism.pp * dp * spec.parallelism.tp
        row["microbatches"] = spec.training.microbatches
        row["compute_bubbles"] = compute_bubble_fraction(spec.parallelism.pp, spec.training.microbatches)
        rows.append(row)
        print(
            f"  {row['gpus']:.0f} GPUs (DP={dp}, {row['microbatches']:.0f} microbatches): Atlas "
            f"{row['iteration_s']:.2f} s/iteration, bubbles {row['bubbles_atlas']:.1%} (compute-only formula "
            f"{row['compute_bubbles']:.1%}), speedup {row['speedup_vs_a']:.2f}x vs (a), {row['speedup_vs_dp']:.2f}x vs "
            f"DP; utilization Atlas {row['util_atlas']:.1%}, +BubbleTea {row['util_atlas_bt']:.1%} "
            f"({time.perf_counter() - t:.0f} s)",
            flush=True,
        )
    return rows


# --- pictures ------------------------------------------------------------------------------------------


def picture(rows: list[dict[str, float]], key: str, xlabel: str, path: Path, *, logx: bool = False) -> None:
    fig = Figure(figsize=(9.0, 3.4), dpi=DPI)
    FigureCanvasAgg(fig)
    left, right = fig.subplots(1, 2)
    xs = [r[key] for r in rows]
    left.plot(xs, [r["speedup_vs_a"] for r in rows], "o-", label="Atlas vs (a) PP, 1 conn., fair")
    left.plot(xs, [r["speedup_vs_dp"] for r in rows], "s-", label="Atlas vs DP across DCs")
    left.axhline(1.0, color="grey", lw=0.8)
    left.set_ylabel("speedup (iteration time ratio)")
    right.plot(xs, [r["util_atlas_bt"] for r in rows], "o-", color="#e0457b", label="Atlas + BubbleTea")
    right.plot(xs, [r["util_atlas"] for r in rows], "o-", color="#3b75af", label="Atlas")
    right.plot(xs, [r["util_a"] for r in rows], "^-", color="#808080", label="(a) PP, 1 conn., fair")
    right.plot(xs, [r["util_dp"] for r in rows], "s--", color="#404040", label="DP across DCs")
    right.set_ylabel("GPU utilization")
    right.set_ylim(0, 1)
    right.yaxis.set_major_formatter(lambda v, _: f"{v:.0%}")
    for ax in (left, right):
        ax.set_xlabel(xlabel)
        if logx:
            ax.set_xscale("log")
            ax.set_xticks(xs, [f"{x:g}" for x in xs])
            ax.minorticks_off()
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=DPI)
    print(f"  wrote {path} ({path.stat().st_size // 1024} KiB)", flush=True)


# --- the claims ----------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="fewer sweep points, scale up to 512 GPUs")
    ap.add_argument("--iterations", type=int, default=3, help="simulated iterations per case (default 3)")
    ap.add_argument(
        "--out",
        type=Path,
        default=None,
        help="folder of the pictures (default docs/paper/; with --quick runs/paper-quick/, so a quick "
        "run never replaces the documented pictures)",
    )
    args = ap.parse_args(argv)
    if args.iterations < 2:
        ap.error(f"--iterations must be at least 2 (iteration 0 is the warm-up), got {args.iterations}")
    if args.out is None:
        args.out = QUICK_PICTURES if args.quick else PICTURES
    wall = time.perf_counter()
    raws = {k: load_raw(p) for k, p in CONFIGS.items()}
    base = spec_of(raws["c"])
    link = base.wan.default
    print(
        f"paper side by side: {base.parallelism.pp * base.parallelism.dp * base.parallelism.tp} GPUs in "
        f"{len(base.datacenters)} DCs, PP={base.parallelism.pp} DP={base.parallelism.dp} TP={base.parallelism.tp}, "
        f"{param_count(base) / 1e9:.2f}B parameters, {base.training.microbatches} microbatches; WAN "
        f"{link.bandwidth_gbps:g} Gb/s, {link.latency_ms:g} ms one way, {link.tcp_window_mib:g} MiB window; "
        f"{args.iterations} simulated iterations per case",
        flush=True,
    )
    print(f"  DP across DCs: WAN ring all-reduce {wan_allreduce_s(base, len(base.datacenters)):.2f} s per iteration")
    cases = table_cases(raws, args.iterations)
    print_table(cases)
    points = QUICK if args.quick else FULL
    bandwidths, latencies, dps = list(points.bandwidths), list(points.latencies), list(points.dps)
    print("WAN bandwidth sweep (40 ms):", flush=True)
    bw = wan_sweep(raws, args.iterations, "bandwidth_gbps", bandwidths)
    print("WAN latency sweep (5 Gb/s):", flush=True)
    lat = wan_sweep(raws, args.iterations, "latency_ms", latencies)
    print("WAN corner (100 ms, 40 Gb/s):", flush=True)
    corner = wan_sweep(
        {k: with_wan(r, latency_ms=100.0) for k, r in raws.items()}, args.iterations, "bandwidth_gbps", [40.0]
    )
    print(f"scale sweep ({GLOBAL_BATCH} sequences per iteration, {SCALE_GBPS_PER_4_REPLICAS:g} Gb/s per 4 replicas):")
    scale = scale_sweep(raws, args.iterations, dps)
    picture(bw, "bandwidth_gbps", "WAN bandwidth per DC pair (Gb/s), 40 ms", args.out / "bandwidth.png", logx=True)
    picture(lat, "latency_ms", "WAN one-way latency (ms), 5 Gb/s", args.out / "latency.png")
    picture(scale, "gpus", "GPUs (fixed global batch, WAN grows with DP)", args.out / "scale.png", logx=True)

    by = {c.name: c for c in cases}
    sweeps = bw + lat + corner + scale
    bt = by["atlas_bubbletea"]
    assert bt.utilization_on is not None and bt.slowdown_pct is not None
    p = base.parallelism.pp
    pipefill_m = max(1, GLOBAL_BATCH // (PIPEFILL_GPUS // (p * base.parallelism.tp)))
    out: dict[str, Any] = {
        "quick": args.quick,
        "iterations": args.iterations,
        "speedup": {c.name: round(speedup(by["pp_1conn_fair"].iteration_s, c.iteration_s), 3) for c in cases},
        "speedup_vs_dp": {c.name: round(speedup(by["dp_overlap"].iteration_s, c.iteration_s), 3) for c in cases},
        "utilization": {c.name: round(c.utilization, 4) for c in cases},
        "utilization_bubbletea": round(bt.utilization_on, 4),
        "placement_speedup": round(speedup(by["naive_placement"].iteration_s, by["atlas"].iteration_s), 3),
        "wan_hops": {"atlas": wan_hops(raws["c"]), "round_robin": wan_hops(raws["rr"])},
        "train_slowdown_pct": bt.slowdown_pct,
        "max_speedup_vs_a": round(max(r["speedup_vs_a"] for r in sweeps), 3),
        "max_speedup_vs_dp": round(max(r["speedup_vs_dp"] for r in sweeps), 3),
        "max_utilization_bubbletea": round(max(r["util_atlas_bt"] for r in sweeps), 4),
        "scale_bubbles": {f"{r['gpus']:.0f}": round(r["bubbles_atlas"], 4) for r in scale},
        "compute_bubbles_8192": round(compute_bubble_fraction(p, pipefill_m), 4),
        "wall_s": round(time.perf_counter() - wall, 1),
    }
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
