"""`write_report`: a run folder in, pictures + table.md + report.md out."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING
from urllib.parse import quote

from bubbletea.report.compute import NULL_CELL, markdown_table, select_iterations
from bubbletea.report.data import ReportError, RunFolder, load_run_folder
from shared.figures.dashboard import view_of_spans
from shared.figures.dashboard_page import render
from shared.figures.runstats import Usage, steady_usage
from shared.policies.spans import Span

if TYPE_CHECKING:
    from matplotlib.figure import Figure

#: The timeline shows this many iterations, from the first after the warm-up iteration 0.
TIMELINE_FIRST = 1
TIMELINE_COUNT = 3

HOW_TO_READ = {
    "timeline": (
        "One row per worker (stage 0 on top), time runs left to right from the start of the first "
        "iteration shown. Blue is forward, green backward (numbers are microbatches), purple all-reduce, "
        "dark grey the optimizer step, light grey other work. Hatched orange is a worker waiting for "
        "a peer's activation or gradient, mostly WAN transfer: the pipeline bubbles. Red inside orange "
        "is prefill filling a bubble; white gaps are idle time."
    ),
    "utilization": (
        "For each run, one bar per worker: the share of the measured window (the spans of iteration 1 "
        "and later, after the warm-up, from the first to the last) spent training, running prefill, or "
        "idle (waiting counts as idle unless prefill filled it). The panel's mean of training + prefill "
        "is the run's GPU utilization in the table."
    ),
    "ttft": (
        "For each run that answered requests: the share of requests (y) whose first token came "
        "within x ms. Further left is faster; the dots mark the median (p50) and the tail (p99)."
    ),
}


@dataclass(frozen=True, slots=True)
class Picture:
    """A written image and where it belongs in report.md."""

    section: str  # a key of HOW_TO_READ
    heading: str
    path: Path


def write_report(run_dir: str | Path, out_dir: str | Path | None = None) -> list[Path]:
    """Write the pictures, table.md and report.md for `run_dir` into `out_dir` (default: run_dir)
    and return the written paths. Pictures with nothing to show (no spans, no TTFTs) are skipped."""
    folder = load_run_folder(run_dir)
    return write_folder_report(folder, Path(out_dir) if out_dir is not None else folder.path)


def write_folder_report(folder: RunFolder, out: Path) -> list[Path]:
    """`write_report` for an already loaded folder (the command prints its table too)."""
    with _writing(out):
        out.mkdir(parents=True, exist_ok=True)
    pictures = [*_timelines(folder, out), *_utilization(folder, out), *_ttft(folder, out)]
    table = markdown_table(folder.summary)
    table_path, report_path = out / "table.md", out / "report.md"
    _write_text(table_path, table)
    _write_text(report_path, report_markdown(folder, table, pictures))
    return [p.path for p in pictures] + [table_path, report_path, *_dashboards(folder, out)]


def _dashboards(folder: RunFolder, out: Path) -> list[Path]:
    """The run page of each run with spans (dashboard-<run>.html, self-contained: the live page's
    drawing with the run inlined), and dashboard.html: the run with the most prefill in its bubbles."""
    written, prefill_s = [], {}
    for run in folder.summary.runs:
        spans = folder.spans[run.name]
        if not spans:
            continue
        view = view_of_spans(run.label, spans, folder.summary.time_scale or 1.0, folder.ttfts_ms[run.name])
        path = out / f"dashboard-{run.name}.html"
        _write_text(path, render(title=run.label, view=view))
        written.append(path)
        prefill_s[path] = sum(s.duration for s in spans if s.kind == "prefill")
    if prefill_s:
        main = out / "dashboard.html"
        _write_text(main, max(prefill_s, key=lambda p: prefill_s[p]).read_text(encoding="utf-8"))
        written.insert(0, main)
    return written


def _timelines(folder: RunFolder, out: Path) -> list[Picture]:
    from bubbletea.report.plots import timeline_figure  # matplotlib is imported only to draw

    pictures = []
    for run in folder.summary.runs:
        spans = folder.spans[run.name]
        if not spans:
            continue
        shown = select_iterations(spans, TIMELINE_FIRST, TIMELINE_COUNT)
        title = f"{run.label}: pipeline timeline, {_iterations_text(shown)}"
        path = out / f"timeline-{run.name}.png"
        _save(timeline_figure(shown, title, folder.summary.time_scale), path)
        pictures.append(Picture("timeline", run.label, path))
    return pictures


def _utilization(folder: RunFolder, out: Path) -> list[Picture]:
    from bubbletea.report.plots import utilization_figure

    usage = usage_by_run(folder)
    if not usage:
        return []
    runs = [folder.spans[r.name] for r in folder.summary.runs if folder.spans[r.name]]
    warmup_skipped = all(any(s.iteration >= 1 for s in spans) for spans in runs)
    window = "iterations 1 and later, warm-up excluded" if warmup_skipped else "all iterations"
    path = out / "utilization.png"
    _save(utilization_figure(usage, f"Where each worker's time went ({window})"), path)
    return [Picture("utilization", "Where the time went", path)]


def usage_by_run(folder: RunFolder) -> list[tuple[str, dict[str, Usage]]]:
    """What utilization.png draws: per run with spans, its label and `steady_usage` (the usage the
    run's headline figures in summary.json are computed from, shared.figures.runstats)."""
    return [(r.label, steady_usage(folder.spans[r.name])) for r in folder.summary.runs if folder.spans[r.name]]


def _ttft(folder: RunFolder, out: Path) -> list[Picture]:
    from bubbletea.report.plots import ttft_figure

    runs = [(r.label, folder.ttfts_ms[r.name]) for r in folder.summary.runs if folder.ttfts_ms[r.name]]
    if not runs:
        return []
    path = out / "ttft.png"
    _save(ttft_figure(runs, folder.summary.time_scale), path)
    return [Picture("ttft", "Time to first token", path)]


def _iterations_text(spans: list[Span]) -> str:
    its = sorted({s.iteration for s in spans})
    if len(its) == 1:
        return f"iteration {its[0]}"
    return f"iterations {its[0]}\N{EN DASH}{its[-1]}"


# --- report.md -------------------------------------------------------------------------------


def report_markdown(folder: RunFolder, table: str, pictures: list[Picture]) -> str:
    """The table, then every picture under a heading with a sentence on how to read it.
    Image links are relative, so the report folder can be moved or published as is."""
    s = folder.summary
    facts = [f"Run folder `{folder.path}`"]
    if s.spec:
        facts.append(f"spec `{s.spec}`")
    if s.created:
        facts.append(f"created {s.created}")
    lines = ["# BubbleTea run report", "", "; ".join(facts) + ".", "", "## Comparison", "", table]
    lines.append(f"A dash ({NULL_CELL}) means not measured in that configuration (e.g. TTFT with BubbleTea off).")
    sections = {"timeline": "Pipeline timelines", "utilization": "Utilization", "ttft": "Time to first token"}
    for section, heading in sections.items():
        chosen = [p for p in pictures if p.section == section]
        if not chosen:
            continue
        lines += ["", f"## {heading}", "", HOW_TO_READ[section]]
        for picture in chosen:
            if section == "timeline":
                lines += ["", f"### {picture.heading}"]
            lines += ["", f"![{_alt(picture.heading)}]({quote(picture.path.name)})"]
    if any(folder.spans[r.name] for r in s.runs):
        page = "the same page `bubbletea up` serves live at /dashboard: zoom and hover on the timeline"
        lines += ["", f"The run's page, to open in a browser: [dashboard.html](dashboard.html) ({page})."]
    lines += ["", "How to read every picture: docs/report.md.", ""]
    return "\n".join(lines)


def _alt(text: str) -> str:
    return text.replace("[", "(").replace("]", ")")


# --- writing ---------------------------------------------------------------------------------


@contextmanager
def _writing(path: Path) -> Iterator[None]:
    """Turn a file-system failure (permissions, a full disk, a file where a folder should be)
    into a ReportError naming the path, like every other report failure."""
    try:
        yield
    except OSError as e:
        raise ReportError(f"{path}: cannot write: {e.strerror or e}") from None


def _save(fig: Figure, path: Path) -> None:
    """Write a PNG; matplotlib is imported here, not at module level, so importing the package
    (e.g. to build the `bubbletea` CLI) stays fast."""
    from bubbletea.report.plots import save_png

    with _writing(path):
        save_png(fig, path)


def _write_text(path: Path, text: str) -> None:
    with _writing(path):
        path.write_text(text, encoding="utf-8")
