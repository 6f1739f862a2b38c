"""The run report: a run folder (the demo's output) turned into pictures and a Markdown table.

    load_run_folder(path) -> RunFolder       read and validate (ReportError names the bad file)
    select_iterations(spans, first, count)    the spans of a few iterations, for the timeline
    markdown_table(summary) -> str            the runs side by side
    write_report(run_dir, out_dir=None)       every picture, table.md and report.md; the paths
    main(argv)                                `bubbletea report RUN_DIR [--out DIR]`

The figures the pictures show (per-worker usage, utilization) are defined in `shared.figures.runstats`.
matplotlib is imported only when pictures are drawn. Format and how to read: docs/report.md.
"""

from bubbletea.report.command import main
from bubbletea.report.compute import markdown_table, select_iterations
from bubbletea.report.data import (
    METRIC_COLUMNS,
    ReportError,
    RunFolder,
    RunInfo,
    Summary,
    load_run_folder,
)
from bubbletea.report.write import write_report
from shared.policies.spans import Span  # the run folder's span record (defined with the figures)

__all__ = [
    "METRIC_COLUMNS",
    "ReportError",
    "RunFolder",
    "RunInfo",
    "Span",
    "Summary",
    "load_run_folder",
    "main",
    "markdown_table",
    "select_iterations",
    "write_report",
]
