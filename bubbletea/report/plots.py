"""The report's pictures, drawn with matplotlib's object-oriented API.

Figures are `matplotlib.figure.Figure` objects attached to an Agg canvas directly, never through
pyplot: no global backend is selected, no figure registry fills up, and nothing here can change
how other code in the same process (tests, notebooks, a GUI) draws.
"""

from __future__ import annotations

import dataclasses
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from matplotlib.axes import Axes
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.patches import Patch
from matplotlib.ticker import FuncFormatter, PercentFormatter

from bubbletea.report.compute import iteration_starts, kind_of
from shared.figures.runstats import USAGE_PARTS, Usage, UsagePart, share, worker_order
from shared.policies.spans import Span

DPI = 120
WIDTH_IN = 12.0
FONT_SIZE = 9  # the smallest text in any picture: bar labels, legends, ticks are this or larger


@dataclass(frozen=True, slots=True)
class KindStyle:
    """How one span kind looks, in the timeline and in the legend."""

    label: str
    face: str
    edge: str = "white"
    hatch: str | None = None
    height: float = 0.8  # of a row
    text: str = "white"  # colour of microbatch numbers written inside the bar


#: Drawing order matters: waits are the background, prefill is drawn last, on top of them.
KIND_STYLES: dict[str, KindStyle] = {
    "wait": KindStyle("WAN / pipeline wait", "#fdd9a8", edge="#e8943a", hatch="///"),
    "fwd": KindStyle("forward", "#3b75af"),
    "bwd": KindStyle("backward", "#4e9a4a"),
    "allreduce": KindStyle("all-reduce", "#8a63b8"),
    "step": KindStyle("optimizer step", "#404040"),
    "other": KindStyle("other", "#b0b0b0", text="black"),
    "prefill": KindStyle("prefill (in a bubble)", "#e0457b", height=0.5),
}
IDLE_STYLE = KindStyle("idle", "white", edge="#808080")

#: The utilization chart's segments, left to right.
USAGE_STYLES: dict[str, KindStyle] = {
    "training": KindStyle("training (fwd, bwd, all-reduce, step)", "#3b75af"),
    "prefill": KindStyle("prefill", "#e0457b"),
    "other": KindStyle("other", "#b0b0b0", text="black"),
    "idle": KindStyle("idle (incl. waiting)", "#ececec", edge="white", text="black"),
}

RUN_COLORS = ("#1f77b4", "#ff7f0e", "#2ca02c", "#9467bd", "#8c564b", "#17becf", "#7f7f7f", "#bcbd22")


def new_figure(height_in: float) -> Figure:
    """A 12-inch-wide figure on its own Agg canvas, laid out by the constrained (tight) layout so
    titles, legends and labels never overlap or get cut off."""
    fig = Figure(figsize=(WIDTH_IN, height_in), dpi=DPI, layout="constrained")
    FigureCanvasAgg(fig)
    return fig


def save_png(fig: Figure, path: Path) -> None:
    fig.savefig(path, format="png", dpi=DPI)


def _legend_patch(style: KindStyle) -> Patch:
    return Patch(facecolor=style.face, edgecolor=style.edge, hatch=style.hatch, label=style.label)


def _style_ticks(ax: Axes) -> None:
    ax.tick_params(labelsize=FONT_SIZE + 1)


# --- 1. the pipeline timeline ----------------------------------------------------------------


def timeline_figure(spans: Sequence[Span], title: str, time_scale: float | None = None) -> Figure:
    """One row per worker (stage 0 on top), bars over time as in GPipe / 1F1B diagrams.

    Time is in ms from the start of the first iteration shown, so runs compare at a glance: device
    ms (real ms / k, as the table's) when the run's time scale `time_scale` is known, and the axis
    says which clock and k; host ms otherwise.
    """
    if time_scale:
        spans = _on_the_device_clock(spans, time_scale)
    workers = worker_order(spans)
    fig = new_figure(max(3.2, 1.8 + 0.5 * len(workers)))
    ax = fig.add_subplot()
    starts = iteration_starts(spans)
    t0 = starts[min(starts)]
    x_min = min(0.0, (min(s.start for s in spans) - t0) * 1000)
    x_max = (max(s.end for s in spans) - t0) * 1000
    row = {w: i for i, w in enumerate(workers)}

    _draw_spans(ax, spans, row, t0)
    _label_microbatches(ax, spans, row, t0, px_per_ms=_px_per_ms(x_max - x_min))
    _mark_iterations(ax, starts, t0)

    ax.set_xlim(x_min, x_max + 0.01 * (x_max - x_min or 1.0))
    ax.set_ylim(len(workers) - 0.5, -0.5)
    ax.set_yticks(range(len(workers)), workers)
    clock = f"device ms (real ms / k, k = {time_scale:g})" if time_scale else "host ms (real time)"
    ax.set_xlabel(f"time since the start of iteration {min(starts)}: {clock}", fontsize=FONT_SIZE + 1)
    ax.set_ylabel("worker (replica r, stage s)", fontsize=FONT_SIZE + 1)
    ax.grid(axis="x", color="#dddddd", linewidth=0.6, zorder=0)
    ax.set_axisbelow(True)
    _style_ticks(ax)
    ax.set_title(title, fontsize=FONT_SIZE + 3, loc="left")

    present = {kind_of(s) for s in spans}
    handles = [_legend_patch(st) for k, st in KIND_STYLES.items() if k != "other" or k in present]
    handles.append(_legend_patch(IDLE_STYLE))
    fig.legend(handles=handles, loc="outside lower center", ncols=len(handles), fontsize=FONT_SIZE, frameon=False)
    return fig


def _on_the_device_clock(spans: Sequence[Span], k: float) -> list[Span]:
    """`spans` with their times since the first one divided by `k`: the device's clock."""
    t0 = min(s.start for s in spans)
    return [
        dataclasses.replace(
            s,
            start=t0 + (s.start - t0) / k,
            end=t0 + (s.end - t0) / k,
            input_at=None if s.input_at is None else t0 + (s.input_at - t0) / k,
        )
        for s in spans
    ]


def _draw_spans(ax: Axes, spans: Sequence[Span], row: dict[str, int], t0: float) -> None:
    """One `broken_barh` per worker and kind (fast even with thousands of spans)."""
    bars: dict[tuple[str, str], list[tuple[float, float]]] = defaultdict(list)
    for s in spans:
        bars[(s.worker, kind_of(s))].append(((s.start - t0) * 1000, s.duration * 1000))
    for z, (kind, style) in enumerate(KIND_STYLES.items()):
        for worker, r in row.items():
            xranges = bars.get((worker, kind))
            if xranges:
                ax.broken_barh(
                    xranges,
                    (r - style.height / 2, style.height),
                    facecolors=style.face,
                    edgecolors=style.edge,
                    linewidth=0.6,
                    hatch=style.hatch,
                    zorder=2 + z,
                )


def _px_per_ms(span_ms: float) -> float:
    """Approximate on-screen pixels per millisecond (the axes take ~88% of the width)."""
    return WIDTH_IN * 0.88 * DPI / max(span_ms, 1e-9)


def _label_microbatches(ax: Axes, spans: Sequence[Span], row: dict[str, int], t0: float, px_per_ms: float) -> None:
    """Write microbatch numbers inside fwd / bwd bars that are wide enough to hold them."""
    for s in spans:
        if s.kind not in ("fwd", "bwd") or s.microbatch is None:
            continue
        text = str(s.microbatch)
        if s.duration * 1000 * px_per_ms < 9 * len(text) + 6:
            continue
        ax.text(
            (s.start - t0 + s.duration / 2) * 1000,
            row[s.worker],
            text,
            ha="center",
            va="center",
            fontsize=FONT_SIZE,
            color=KIND_STYLES[s.kind].text,
            zorder=20,
            clip_on=True,
        )


def _mark_iterations(ax: Axes, starts: dict[int, float], t0: float) -> None:
    """Dotted lines where each iteration starts, named on a top axis."""
    xs = [(t - t0) * 1000 for t in starts.values()]
    for x in xs:
        ax.axvline(x, color="#555555", linestyle=":", linewidth=1.0, zorder=1)
    top = ax.secondary_xaxis("top")
    top.set_xticks(xs, [f"iteration {i}" for i in starts])
    top.tick_params(labelsize=FONT_SIZE, length=0)


# --- 2. utilization --------------------------------------------------------------------------


def utilization_figure(runs: Sequence[tuple[str, dict[str, Usage]]], title: str) -> Figure:
    """Stacked bars, one per worker, one panel per run: the share of the window each worker spent
    training, prefilling, or idle, with the percentages written on the bars."""
    rows = sum(len(usage) for _, usage in runs)
    fig = new_figure(1.4 + 0.42 * rows + 0.55 * len(runs))
    axes = fig.subplots(len(runs), 1, sharex=True, squeeze=False, height_ratios=[len(u) or 1 for _, u in runs])
    parts = [p for p in USAGE_PARTS if p != "other" or any(u["other"] > 0 for _, us in runs for u in us.values())]
    for ax, (label, usage) in zip(axes[:, 0], runs, strict=True):
        _usage_panel(ax, label, usage, parts)
    last = axes[-1, 0]
    last.set_xlim(0, 1)
    last.xaxis.set_major_formatter(PercentFormatter(1.0))
    last.set_xlabel("share of the measured window", fontsize=FONT_SIZE + 1)
    fig.suptitle(title, fontsize=FONT_SIZE + 3)
    handles = [_legend_patch(USAGE_STYLES[p]) for p in parts]
    fig.legend(handles=handles, loc="outside lower center", ncols=len(handles), fontsize=FONT_SIZE, frameon=False)
    return fig


def _fractions(usage: dict[str, Usage], part: UsagePart) -> np.ndarray:
    return np.array([share(u, part) for u in usage.values()])


def _usage_panel(ax: Axes, label: str, usage: dict[str, Usage], parts: Sequence[UsagePart]) -> None:
    y = np.arange(len(usage))
    left = np.zeros(len(usage))
    means = []
    for part in parts:
        style = USAGE_STYLES[part]
        share = _fractions(usage, part)
        bars = ax.barh(y, share, left=left, height=0.7, color=style.face, edgecolor="white", linewidth=0.8)
        texts = [f"{v * 100:.1f}%" if v >= 0.05 else "" for v in share]
        ax.bar_label(bars, labels=texts, label_type="center", fontsize=FONT_SIZE, color=style.text)
        left += share
        if part != "other" or share.any():
            means.append(f"{part} {share.mean() * 100:.1f}%")
    ax.set_yticks(y, list(usage))
    ax.set_ylim(len(usage) - 0.5, -0.5)
    _style_ticks(ax)
    ax.set_title(f"{label}    (mean over workers: {', '.join(means)})", fontsize=FONT_SIZE + 1, loc="left")


# --- 3. time to first token ------------------------------------------------------------------


def ttft_figure(runs: Sequence[tuple[str, Sequence[float]]], time_scale: float | None = None) -> Figure:
    """One CDF per run, with dots and dotted drop lines at p50 and p99 (the tail matters most); in
    device ms (real / k, as the table's) when the runs' time scale is known, else host ms."""
    if time_scale:
        runs = [(label, [t / time_scale for t in ttfts]) for label, ttfts in runs]
    fig = new_figure(5.0)
    ax = fig.add_subplot()
    values = np.concatenate([np.asarray(t, dtype=float) for _, t in runs])
    for i, (label, ttfts) in enumerate(runs):
        _cdf(ax, label, np.sort(np.asarray(ttfts, dtype=float)), RUN_COLORS[i % len(RUN_COLORS)])
    positive = values[values > 0]
    if positive.size and positive.size == values.size and positive.max() / positive.min() > 100:
        ax.set_xscale("log")
        ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _pos: f"{v:g}"))  # 10, 100, not 10^1
    for q in (0.5, 0.99):
        ax.axhline(q, color="#bbbbbb", linewidth=0.8, linestyle="--", zorder=0)
    ax.set_ylim(0, 1.02)
    ax.yaxis.set_major_formatter(PercentFormatter(1.0))
    clock = f"device ms (real ms / k, k = {time_scale:g})" if time_scale else "host ms (real time)"
    ax.set_xlabel(f"time to first token: {clock}", fontsize=FONT_SIZE + 1)
    ax.set_ylabel("requests answered within x", fontsize=FONT_SIZE + 1)
    ax.grid(color="#eeeeee", linewidth=0.6)
    _style_ticks(ax)
    ax.set_title("Time to first token, cumulative distribution (dots: p50 and p99)", fontsize=FONT_SIZE + 3, loc="left")
    ax.legend(loc="lower right", fontsize=FONT_SIZE + 1)
    return fig


def _cdf(ax: Axes, label: str, xs: np.ndarray, color: str) -> None:
    p50, p99 = np.percentile(xs, [50, 99])
    ys = np.arange(1, xs.size + 1) / xs.size
    name = f"{label}  (n={xs.size}, p50 {p50:.1f} ms, p99 {p99:.1f} ms)"
    ax.step(
        np.concatenate([[xs[0]], xs]), np.concatenate([[0.0], ys]), where="post", color=color, linewidth=2, label=name
    )
    ax.plot([p50, p99], [0.5, 0.99], "o", color=color, markersize=7, zorder=5)
    ax.vlines([p50, p99], 0, [0.5, 0.99], colors=color, linestyles=":", linewidth=1.2)
