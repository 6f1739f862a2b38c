"""What a simulation shows: its figures (one dict), the lines a person reads, and a run folder.

The run folder has the live format (docs/report.md): summary.json with one run per simulation
("off", "on"), each run's spans.jsonl and the TTFTs, so `bubbletea report DIR` draws the same
timeline, utilization and TTFT pictures as for a live run.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from shared.figures import runstats
from shared.figures.percentiles import percentile
from shared.figures.requests import ttft_ms
from shared.figures.training import slowdown_pct
from shared.wire.status import FailureReason
from sim.run import SimResult

LABEL_OFF = "Simulated: BubbleTea off"
LABEL_ON = "Simulated: BubbleTea on"


def figures(r: SimResult) -> dict[str, Any]:
    """Every figure of a simulation; the keys of the `--json` line."""
    spec = r.setup.spec
    off_u = runstats.utilization(r.off.spans)
    par = spec.parallelism
    out: dict[str, Any] = {
        "spec": spec.name,
        "gpus": par.pp * par.dp * par.tp,
        "slots": par.pp * par.dp,
        "iterations": len(r.off.iteration_times),
        "iteration_ms_off": _ms(r.off.iteration_s),
        "bubble_fraction": round(off_u.bubble, 4),
        "utilization_off": round(off_u.busy, 4),
    }
    on = r.on
    if on is None or on.serving is None:
        out["iteration_ms"] = out["iteration_ms_off"]
        out.update(events=r.off.events, wall_s=round(r.off.wall_s, 3))
        return out
    u, s = runstats.utilization(on.spans), on.serving
    ttfts = [t * 1000 for t in s.ttfts_s]
    p50, p99 = ttft_ms(ttfts, 50), ttft_ms(ttfts, 99)
    answered = len(s.ttfts_s)
    events, wall = r.off.events + on.events, r.off.wall_s + on.wall_s
    worked = s.worked_share or 0.0  # of the prefill time, the share that computed prompt tokens
    overruns = [o * 1000 for o in s.overruns_s]
    gpus = out["gpus"]
    out.update(
        iteration_ms=_ms(on.iteration_s),
        bubble_fraction_on=round(u.bubble, 4),
        utilization_on=round(u.busy, 4),
        fill_ratio=round(u.fill_ratio, 4),
        # the headline: training, and the prefill time that computed prompt tokens (blocks' fixed parts apart)
        useful_utilization_on=round(u.training + u.prefill * worked, 4),
        useful_fill_ratio=round(u.fill_ratio * worked, 4),
        overrun_p50_ms=None if not overruns else round(_pct(overruns, 50), 4),
        overrun_p99_ms=None if not overruns else round(_pct(overruns, 99), 4),
        filled_bubbles=len(overruns),
        train_slowdown_pct=round(slowdown_pct(on.iteration_s, r.off.iteration_s), 3) + 0.0,  # no -0.0
        ttft_p50_ms=None if p50 is None else round(p50, 2),
        ttft_p99_ms=None if p99 is None else round(p99, 2),
        request_rate=None if r.request_rate is None else round(r.request_rate, 2),
        requests_sent=s.sent,
        requests_served=answered,
        requests_expired=s.failed.get(FailureReason.DEADLINE.value, 0),
        requests_rejected=s.rejected,
        requests_moved=s.moved,
        requests_unfinished=s.sent - s.rejected - answered - sum(s.failed.values()) - s.moved,
        bubble_token_share=None if s.bubble_token_share is None else round(s.bubble_token_share, 4),
        prefill_tokens_per_s=round(s.tokens / on.makespan, 1) if on.makespan > 0 else 0.0,
        prefill_tokens_per_gpu_s=round(s.tokens / on.makespan / gpus, 2) if on.makespan > 0 else 0.0,
        recomputed_share=None if s.recomputed_share is None else round(s.recomputed_share, 4),
        dispatch=r.setup.serving.dispatch.value,
        requests_failed=dict(sorted(s.failed.items())),  # by FailureReason (expired is DEADLINE's)
        # answered within the TTFT objective, of the requests sent (None: no objective)
        slo_attainment=_attainment(s.ttfts_s, s.sent, r.setup.serving.objective_s),
        requests_routed=dict(sorted(s.routed.items())),  # per DC dispatch: by `dc_routing.RouteWhy`
        requests_served_by_dc=dict(sorted(s.answered_in.items())),
        events=events,
        wall_s=round(wall, 3),
        events_per_s=round(events / wall) if wall > 0 else None,
    )
    return out


def lines(r: SimResult, f: dict[str, Any]) -> list[str]:
    """The human-readable summary."""
    s = r.setup
    par = s.spec.parallelism
    out = [
        f"simulated {s.spec.name}: {f['gpus']} GPUs (PP={par.pp} x DP={par.dp} x TP={par.tp}), "
        f"{s.spec.training.schedule}, {s.spec.training.microbatches} microbatches, WAN sharing {s.spec.wan.sharing}, "
        f"{f['iterations']} iterations",
        f"  training: {s.training_profile} (fwd {s.fwd_ms_per_layer:g} ms, bwd {s.bwd_ms_per_layer:g} ms per layer)",
        f"  prefill:  {s.prefill_profile}; served model {s.model.layers} layers",
        f"  BubbleTea off: iteration {f['iteration_ms_off']:.2f} ms, bubble fraction {f['bubble_fraction']:.1%}, "
        f"utilization {f['utilization_off']:.1%}",
    ]
    if "utilization_on" not in f:
        return out
    load = (
        f"trace {r.options.trace} (time scale {r.options.time_scale:g})"
        if r.options.trace is not None
        else f"{f['request_rate']:g} requests/s"
    )
    ttft = (
        f"TTFT p50 {f['ttft_p50_ms']:.1f} ms, p99 {f['ttft_p99_ms']:.1f} ms"
        if f["ttft_p50_ms"] is not None
        else "no request answered"
    )
    out += [
        f"  BubbleTea on ({load}): iteration {f['iteration_ms']:.2f} ms "
        f"(training slowdown {f['train_slowdown_pct']:+.2f}%), utilization {f['utilization_on']:.1%} "
        f"(useful {f['useful_utilization_on']:.1%}: the blocks' fixed parts apart), fill ratio {f['fill_ratio']:.1%}",
        f"  requests: {f['requests_sent']} sent, {f['requests_served']} served, {f['requests_expired']} expired, "
        f"{f['requests_rejected']} rejected, {f['requests_unfinished']} unfinished at the end; {ttft}; "
        f"{f['prefill_tokens_per_s']:.0f} prompt tokens/s",
        f"  {f['events']} events in {f['wall_s']:.2f} s",
    ]
    if f["dispatch"] == "per_dc":
        routed = ", ".join(f"{n} {why}" for why, n in f["requests_routed"].items()) or "none"
        served = ", ".join(f"{n} in {dc}" for dc, n in f["requests_served_by_dc"].items()) or "none"
        out.insert(-1, f"  a dispatcher per datacenter: requests routed {routed}; served {served}")
    if f["requests_moved"] or s.serving.objective_s is not None:
        share = f["bubble_token_share"]
        objective = "none" if s.serving.objective_s is None else f"{s.serving.objective_s * 1000:g} ms"
        taken = "no" if share is None else f"{share:.1%} of the"
        out.insert(
            -1,
            f"  placement {s.serving.placement.value}, TTFT objective {objective}: {f['requests_moved']} requests "
            f"to the decoder, {taken} prompt tokens computed in the bubbles",
        )
    return out


def write_folder(r: SimResult, f: dict[str, Any], root: Path) -> Path:
    """A run folder under `root` in the live format; returns its path."""
    base = root / time.strftime(f"sim-{r.setup.spec.name}-%Y%m%d-%H%M%S")
    folder, n = base, 1
    while folder.exists():
        n += 1
        folder = base.with_name(f"{base.name}-{n}")
    runs = [_run_entry("off", LABEL_OFF, f, on=False)]
    (folder / "off").mkdir(parents=True)
    runstats.write_spans(folder / "off" / "spans.jsonl", r.off.spans)
    if r.on is not None and r.on.serving is not None:
        runs.append(_run_entry("on", LABEL_ON, f, on=True))
        (folder / "on").mkdir()
        runstats.write_spans(folder / "on" / "spans.jsonl", r.on.spans)
        ttfts = [round(t * 1000, 3) for t in r.on.serving.ttfts_s]
        (folder / "on" / "ttft_ms.json").write_text(json.dumps(ttfts))
    summary = {
        "spec": r.setup.spec.name,
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "simulated": True,
        "figures": f,
        "runs": runs,
    }
    (folder / "summary.json").write_text(json.dumps(summary, indent=2))
    return folder


def _run_entry(name: str, label: str, f: dict[str, Any], *, on: bool) -> dict[str, Any]:
    metrics: dict[str, Any] = {
        "iteration_ms": f["iteration_ms"] if on else f["iteration_ms_off"],
        "bubble_fraction": f["bubble_fraction_on"] if on else f["bubble_fraction"],
        "utilization": f["utilization_on"] if on else f["utilization_off"],
        "prefill_tokens_per_s": f["prefill_tokens_per_s"] if on else 0.0,
        "ttft_p50_ms": f["ttft_p50_ms"] if on else None,
        "ttft_p99_ms": f["ttft_p99_ms"] if on else None,
        "train_slowdown_pct": f["train_slowdown_pct"] if on else 0.0,
        "requests_lost": 0 if on else None,  # the simulator answers or fails every request explicitly
    }
    if on:
        metrics.update(bubble_fill_ratio=f["fill_ratio"], requests_answered=f["requests_served"])
    return {"name": name, "label": label, "metrics": metrics}


def _attainment(ttfts_s: list[float], sent: int, objective_s: float | None) -> float | None:
    if objective_s is None or not sent:
        return None
    return round(sum(1 for t in ttfts_s if t <= objective_s) / sent, 4)


def _pct(values: list[float], p: float) -> float:
    got = percentile(values, p)
    assert got is not None
    return got


def _ms(seconds: float) -> float:
    return round(seconds * 1000, 3)
