"""A live run against its simulation, figure by figure (`bench/sim_vs_live.py`): the figures each
side is reduced to, their errors, and the table's lines."""

from __future__ import annotations

from typing import Any

from shared.figures import runstats
from shared.figures.bubblestats import overruns_ms

FIGURES = ("iteration", "bubble_fraction", "fill_ratio")


def figures(iteration_s: float, spans: list[runstats.Span], bubbletea: bool) -> dict[str, float | None]:
    u = runstats.utilization(spans)
    fill = u.fill_ratio if bubbletea else None
    return {"iteration": iteration_s * 1000, "bubble_fraction": u.bubble, "fill_ratio": fill}


def overrun_share(spans: list[runstats.Span]) -> float:
    """Training's wait past its input in filled bubbles (`bubblestats.overruns_ms`), as a share of
    the workers' steady time: what filling cost training. Compared as a difference (points), not a
    ratio: the fit rule takes it near 0 on both sides, where a ratio means nothing."""
    u = runstats.utilization(spans)
    total = u.window_s * u.workers
    return sum(overruns_ms(spans)) / 1000 / total if total > 0 else 0.0


def r4(v: float | None) -> float | None:
    return None if v is None else round(v, 4)


def rel(value: float | None, reference: float | None) -> float | None:
    """|value - reference| / |reference| (None where either is missing or the reference is 0)."""
    if value is None or reference is None or reference == 0:
        return None
    return round(abs(value - reference) / abs(reference), 4)


def line(r: dict[str, Any]) -> str:
    def cell(f: str) -> str:
        if r[f"{f}_live"] is None:
            return " " * 28
        scale = 1.0 if f == "iteration" else 100.0
        return f"{r[f'{f}_live'] * scale:8.2f} {r[f'{f}_sim'] * scale:8.2f} {r[f'{f}_rel_err'] * 100:5.1f}%  "

    lag = f"{r['prefill_lag_share']:.1%}" if "prefill_lag_share" in r else ""
    model = f"{r['iteration_model']:8.2f} {r['iteration_model_rel_err'] * 100:5.1f}%"
    return (
        f"| {r['case']:<24} | " + " | ".join(cell(f) for f in FIGURES) + f" | {model} | {r['lag_ms']:8.1f} | {lag:>8} |"
    )


def summary(rows: list[dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}

    def worst(f: str) -> float | None:
        errs = [r[f"{f}_rel_err"] for r in rows if r.get(f"{f}_rel_err") is not None]
        return max(errs) if errs else None

    for f in FIGURES:
        out[f"{f}_rel_err"] = worst(f)
    out["max_rel_err"] = max((v for v in out.values() if v is not None), default=None)  # live against sim
    gaps = [r["overrun_share_abs_err"] for r in rows if r.get("overrun_share_abs_err") is not None]
    out["overrun_share_abs_err"] = max(gaps) if gaps else None  # points of the workers' time
    out["iteration_model_rel_err"] = worst("iteration_model")
    out["iteration_sim_model_rel_err"] = worst("iteration_sim_model")
    out["cases"] = {r["case"]: {k: v for k, v in r.items() if k != "case"} for r in rows}
    return out
