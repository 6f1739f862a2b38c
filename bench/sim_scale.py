"""How fast the simulator runs at scale: 512, 2,048 and 8,192 GPUs with BubbleTea on.

Each case is 4 datacenters of G/4 GPUs, TP=8, PP=16 (4 consecutive stages per DC, 3 WAN hops),
DP = G/128, so G/8 pipeline slots; a 64-layer model with a device profile, 16 microbatches of one
2k-token sequence, a 400 Gb/s, 20 ms WAN with 64 connections per transfer; a 32-layer served model
with a prefill profile, Poisson requests of ~512-token prompts at half the rate the bubbles could hold.
Each case simulates BubbleTea off (the priors) and on; `s_per_iter_<G>` is wall seconds per
simulated iteration of the BubbleTea-on run, `events_per_s` the event rate of the largest case;
`cpu_s_per_iter_<G>` is the same run's CPU seconds (the machine is shared: wall time includes
waiting for a core). Last line: one JSON object. Target (issue 11): one 8,192-GPU iteration in under 5 s.

    python bench/sim_scale.py            # 512, 2,048, 8,192 GPUs, 3 iterations each
    python bench/sim_scale.py --quick    # 512 and 2,048 GPUs, 2 iterations
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

from shared.spec.config import ClusterSpec, parse_spec
from sim.output import figures
from sim.run import RunResult, SimOptions, simulate

INPUT_LEN = 512
#: The load as a share of what the bubbles could hold (sim.run.capacity_rate).
LOAD = 0.5


def scale_spec(gpus: int) -> ClusterSpec:
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
        "training": {"schedule": "1f1b", "microbatches": 16, "microbatch_size": 1, "iterations": 3},
        "device": {
            "fwd_ms_per_layer": 2.0,
            "bwd_ms_per_layer": 4.0,
            "allreduce_ms": 100.0,
            "step_ms": 10.0,
            "memory_gib": 80,
            "prefill_ms_per_layer": 0.5,
            "prefill_us_per_token": 4.0,
        },
        "bubbletea": {"max_batch_requests": 32},
        "prefill": {
            "model": {"layers": 32, "d_model": 4096, "heads": 32, "seq_len": 4096, "vocab": 32000},
            "max_prompt_tokens": 2048,
        },
    }
    return parse_spec(raw, source=f"scale-{gpus}")


def dispatcher_inputs(on: RunResult) -> int:
    """Every message the dispatcher takes in a simulated run: requests, two per bubble, a report per batch."""
    s = on.serving
    assert s is not None, "a run with BubbleTea on"
    bubbles = sum(1 for sp in on.spans if sp.kind == "wait")
    return s.sent + 2 * bubbles + s.batches


def run_case(gpus: int, iterations: int) -> dict[str, Any]:
    spec = scale_spec(gpus)
    t0 = time.perf_counter()
    result = simulate(spec, SimOptions(iterations=iterations, input_len=INPUT_LEN, load=LOAD, seed=0))
    wall = time.perf_counter() - t0
    f = figures(result)
    on = result.on
    assert on is not None
    row = {
        "gpus": gpus,
        "slots": f["slots"],
        "iteration_ms": f["iteration_ms"],
        "bubble_fraction": f["bubble_fraction"],
        "utilization_off": f["utilization_off"],
        "utilization_on": f["utilization_on"],
        "fill_ratio": f["fill_ratio"],
        "train_slowdown_pct": f["train_slowdown_pct"],
        "requests_served": f["requests_served"],
        "recomputed_share": f["recomputed_share"],
        # what one dispatcher would take in a second of this job (requests, bubble starts and ends,
        # batch reports: one per batch): sized against bench/dispatcher.py's inputs per core-second
        "dispatcher_inputs_per_s": round(dispatcher_inputs(on) / on.makespan) if on.makespan > 0 else None,
        "events_on": on.events,
        "s_per_iter_on": round(on.wall_s / iterations, 3),
        "s_per_iter_off": round(result.off.wall_s / iterations, 3),
        "cpu_s_per_iter_on": round(on.cpu_s / iterations, 3),
        "events_per_s": round(on.events / on.wall_s),
        "wall_s": round(wall, 2),
    }
    print(
        f"{gpus:>5} GPUs ({row['slots']} slots): {row['s_per_iter_on']:.2f} s per simulated iteration with "
        f"BubbleTea on ({row['cpu_s_per_iter_on']:.2f} s CPU; {row['s_per_iter_off']:.2f} s off), "
        f"{row['events_on']} events at {row['events_per_s']}/s; "
        f"iteration {row['iteration_ms']:.0f} ms, bubbles {row['bubble_fraction']:.1%}, utilization "
        f"{row['utilization_off']:.1%} -> {row['utilization_on']:.1%}, fill {row['fill_ratio']:.1%}, "
        f"slowdown {row['train_slowdown_pct']:+.2f}%",
        flush=True,
    )
    return row


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="512 and 2,048 GPUs, 2 iterations")
    ap.add_argument("--iterations", type=int, default=None, help="simulated iterations per case (default 3)")
    args = ap.parse_args(argv)
    sizes = (512, 2048) if args.quick else (512, 2048, 8192)
    iterations = args.iterations or (2 if args.quick else 3)
    rows = [run_case(g, iterations) for g in sizes]
    out: dict[str, Any] = {f"s_per_iter_{r['gpus']}": r["s_per_iter_on"] for r in rows}
    out.update({f"cpu_s_per_iter_{r['gpus']}": r["cpu_s_per_iter_on"] for r in rows})
    out["events_per_s"] = rows[-1]["events_per_s"]
    out["iterations"] = iterations
    out["cases"] = rows
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
