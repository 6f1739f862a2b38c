"""The run report: a run folder (the demo's output) turned into pictures and a Markdown table.

    load_run_folder(path) -> RunFolder       read and validate (ReportError names the bad file)
    utilization(spans, window=None)           per worker: training / prefill / other / idle seconds
    select_iterations(spans, first, count)    the spans of a few iterations, for the timeline
    markdown_table(summary) -> str            the runs side by side
    write_report(run_dir, out_dir=None)       every picture, table.md and report.md; the paths
    main(argv)                                `bubbletea report RUN_DIR [--out DIR]`

matplotlib is imported only when pictures are drawn. Format and how to read: docs/report.md.
"""

from shared.report.command import main
from shared.report.compute import (
    Usage,
    full_window,
    markdown_table,
    select_iterations,
    steady_window,
    union_length,
    utilization,
)
from shared.report.data import (
    METRIC_COLUMNS,
    ReportError,
    RunFolder,
    RunInfo,
    Span,
    Summary,
    load_run_folder,
)
from shared.report.write import write_report

__all__ = [
    "METRIC_COLUMNS",
    "ReportError",
    "RunFolder",
    "RunInfo",
    "Span",
    "Summary",
    "Usage",
    "full_window",
    "load_run_folder",
    "main",
    "markdown_table",
    "select_iterations",
    "steady_window",
    "union_length",
    "utilization",
    "write_report",
]
