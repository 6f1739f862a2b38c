"""bench/atlas.py's JSON line: its keys with their clocks (`SCHEMA`), the targets and validity
bounds, and `summarize`, which makes the line from the three runs' rows (pure)."""

from __future__ import annotations

import statistics
from typing import Any

from bench.lib.output import verdict
from shared.figures.percentiles import percentile
from shared.figures.training import speedup
from shared.policies.wan import BUS_HOP_S

#: Targets of the kernel-mode runs (docs/benchmarks.md): each measured speedup within this relative gap of
#: the model's, and the least link efficiency of the runs that can fill their links at least this.
SPEEDUP_GAP_MAX = 0.10
LINK_EFFICIENCY_MIN = 0.85
#: Validity: the model-mode runs keep the policy's schedule (the plumbing) within this relative
#: error, and the broker alone delivers within this many ms (p99) of the emulated arrival.
PLUMBING_ERROR_MAX = 0.05
BROKER_LATE_P99_MAX_MS = 1.0
#: Validity, every mode: real compute stays behind its profile (the padding) by at most this share
#: of the workers' time; beyond it the machine, not the WAN, sets the pace.
LAG_SHARE_MAX = 0.02

#: The JSON line's keys. Clocks: `wall` = real time on this host (the workers' stamps of each
#: iteration's end; the broker's and the receivers' monotonic clocks); `model` = the analytic
#: model's virtual clock (profiled device time; these runs use no time scale, so one model ms
#: stands for one wall ms).
SCHEMA: dict[str, str] = {
    "wan": "the WAN mode of the runs: kernel or model",
    "wan_why": "why that mode: the default's reason (root and namespaces, or why not), or --wan",
    "iterations": "iterations per run (the first is left out of every iteration figure)",
    "iter_ms_fair": "wall, ms: steady iteration (median of iterations 2..n), fair sharing, 8 connections",
    "iter_ms_temporal": "wall, ms: the same, temporal sharing (Atlas), 8 connections",
    "iter_ms_multiconn": "wall, ms: = iter_ms_temporal (the several-connection side of speedup_multiconn)",
    "iter_ms_1conn": "wall, ms: the same, temporal sharing, 1 connection",
    "model_iter_ms_fair": "model, ms: the analytic model's steady iteration for the fair run",
    "model_iter_ms_temporal": "model, ms: the same for the temporal run",
    "model_iter_ms_1conn": "model, ms: the same for the 1-connection run",
    "speedup_temporal": "ratio (wall / wall): iter_ms_fair / iter_ms_temporal",
    "model_speedup_temporal": "ratio (model / model): the model's fair / temporal",
    "speedup_temporal_gap": "ratio: |speedup_temporal / model_speedup_temporal - 1|",
    "speedup_multiconn": "ratio (wall / wall): iter_ms_1conn / iter_ms_multiconn",
    "model_speedup_multiconn": "ratio (model / model): the model's 1-connection / temporal",
    "speedup_multiconn_gap": "ratio: |speedup_multiconn / model_speedup_multiconn - 1|",
    "model_error_max": "ratio: the largest |measured / model - 1| of the three runs' iterations",
    "broker_late_p99_ms": "wall, ms: the broker alone on loopback, delivery minus the emulated arrival, p99 "
    "(model mode; null in kernel mode, where the broker releases nothing)",
    "broker_late_p99_ms_under_training": "wall, ms: the same during the runs (model mode; null in kernel mode)",
    "lag_share_max": "ratio (wall): of the runs, the most real compute ran behind its profile, over the "
    "workers' time (iterations x workers)",
    "control_hop_ms_p50": "wall, ms: a SlotRequest's bus hop, worker to broker (the broker's log: its send to "
    "its read), median over the runs (kernel mode; null in model mode)",
    "control_hop_ms_p90": "wall, ms: the same, 90th percentile",
    "model_control_hop_ms": "model, ms: the bus hop the model assumes (BUS_HOP_S; null in model mode)",
    "link_efficiency_min": "ratio (wall bytes/s over the link's rate): least over the links of the runs "
    "whose one transfer can fill the link (8 connections); null in model mode",
    "link_efficiency_fair": "ratio: least over the links of the fair run; null in model mode",
    "link_efficiency_temporal": "ratio: least over the links of the temporal run; null in model mode",
    "link_efficiency_1conn": "ratio: least over the links of the 1-connection run (its transfers reach a "
    "quarter of the link each); null in model mode",
    "targets": "kernel mode: per target, its value, the bound and whether it is met (null in model mode)",
    "valid": "bool: the validity checks passed (the run measured what it says)",
    "why": "str: what the validity checks found",
}


def _r(x: float | None, digits: int) -> float | None:
    return None if x is None else round(x, digits)


def summarize(
    wan: str,
    wan_why: str,
    iters: int,
    fair: dict[str, Any],
    temporal: dict[str, Any],
    one: dict[str, Any],
    alone: float | None,
) -> dict[str, Any]:
    """The JSON line (`SCHEMA`) from the three runs' rows: figures, targets and validity."""
    rows = {"fair-8conn": fair, "temporal-8conn": temporal, "temporal-1conn": one}
    speedup_t = speedup(fair["measured_ms"], temporal["measured_ms"])
    model_t = speedup(fair["model_ms"], temporal["model_ms"])
    speedup_m = speedup(one["measured_ms"], temporal["measured_ms"])
    model_m = speedup(one["model_ms"], temporal["model_ms"])
    model_mode = wan == "model"
    filling = [r["link_efficiency"] for r in rows.values() if r["fills_link"] and r["link_efficiency"] is not None]
    eff_min = None if model_mode or not filling else min(filling)
    lag_share = max(r["lag_share"] for r in rows.values())
    hops = [h for r in rows.values() for h in r["hops_ms"]]
    out: dict[str, Any] = {
        "wan": wan,
        "wan_why": wan_why,
        "iter_ms_fair": round(fair["measured_ms"], 2),
        "iter_ms_temporal": round(temporal["measured_ms"], 2),
        "model_iter_ms_fair": round(fair["model_ms"], 2),
        "model_iter_ms_temporal": round(temporal["model_ms"], 2),
        "speedup_temporal": round(speedup_t, 3),
        "model_speedup_temporal": round(model_t, 3),
        "speedup_temporal_gap": round(abs(speedup_t / model_t - 1), 4),
        "iter_ms_1conn": round(one["measured_ms"], 2),
        "iter_ms_multiconn": round(temporal["measured_ms"], 2),
        "model_iter_ms_1conn": round(one["model_ms"], 2),
        "speedup_multiconn": round(speedup_m, 3),
        "model_speedup_multiconn": round(model_m, 3),
        "speedup_multiconn_gap": round(abs(speedup_m / model_m - 1), 4),
        "model_error_max": round(max(r["error"] for r in rows.values()), 4),
        "broker_late_p99_ms": _r(alone, 3),
        "broker_late_p99_ms_under_training": (
            round(max(r["broker_late_p99_ms"] for r in rows.values()), 3) if model_mode else None
        ),
        "lag_share_max": round(lag_share, 4),
        "control_hop_ms_p50": round(statistics.median(hops), 3) if hops else None,
        "control_hop_ms_p90": round(percentile(hops, 90), 3) if hops else None,
        "model_control_hop_ms": None if model_mode else BUS_HOP_S * 1000,
        "link_efficiency_min": _r(eff_min, 3),
        "link_efficiency_fair": _r(fair["link_efficiency"], 3),
        "link_efficiency_temporal": _r(temporal["link_efficiency"], 3),
        "link_efficiency_1conn": _r(one["link_efficiency"], 3),
        "iterations": iters,
    }
    problems = []
    if lag_share > LAG_SHARE_MAX:
        problems.append(
            f"real compute ran {lag_share:.1%} of the workers' time behind its profile (more than "
            f"{LAG_SHARE_MAX:.0%}): the machine, not the WAN, set the pace"
        )
    if model_mode:
        # the broker releases receivers at the model's own times: agreement checks the plumbing
        if out["model_error_max"] > PLUMBING_ERROR_MAX:
            problems.append(
                f"model mode: a run's iteration is {out['model_error_max']:.1%} off the model its broker "
                f"follows (more than {PLUMBING_ERROR_MAX:.0%}): the services did not keep the policy's schedule"
            )
        if alone is not None and alone >= BROKER_LATE_P99_MAX_MS:
            problems.append(f"the broker alone delivered {alone:.2f} ms late (p99, bound {BROKER_LATE_P99_MAX_MS} ms)")
        ok = "model mode: the live runs keep the link model's schedule (plumbing) and compute kept its profile"
        out["targets"] = None
    else:
        for tag, r in rows.items():
            if r["link_efficiency"] is None:
                problems.append(f"{tag}: no link reported bytes with time on the wire")
            elif r["link_efficiency"] > 1.0:
                problems.append(
                    f"{tag}: link efficiency {r['link_efficiency']:.2f} above 1: the receivers' wire times "
                    "miss part of the time the link was busy"
                )
        ok = "kernel mode: compute kept its profile and every link's efficiency is a share of its rate"
        out["targets"] = {
            "speedup_temporal_gap": _target(out["speedup_temporal_gap"], SPEEDUP_GAP_MAX, "<="),
            "speedup_multiconn_gap": _target(out["speedup_multiconn_gap"], SPEEDUP_GAP_MAX, "<="),
            "link_efficiency_min": _target(out["link_efficiency_min"], LINK_EFFICIENCY_MIN, ">="),
        }
    out.update(verdict(problems, ok))
    return out


def _target(value: float | None, bound: float, op: str) -> dict[str, Any]:
    met = value is not None and (value <= bound if op == "<=" else value >= bound)
    return {"value": value, "bound": f"{op} {bound}", "met": met}
