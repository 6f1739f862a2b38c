"""`bubbletea report RUN_DIR [--out DIR]` (also `python -m bubbletea.report RUN_DIR`)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from bubbletea.report.compute import markdown_table
from bubbletea.report.data import ReportError, load_run_folder
from bubbletea.report.write import write_folder_report

DESCRIPTION = """\
Turn a run folder written by the demo into pictures and a Markdown table: a pipeline timeline
per run (timeline-<run>.png), per-worker utilization (utilization.png), the time-to-first-token
distribution (ttft.png, when requests were answered), table.md, and report.md linking them all.
"""

EPILOG = """\
The run folder holds summary.json and, per run, <run>/spans.jsonl and <run>/ttft_ms.json.
How to read the pictures, and the exact folder format: docs/report.md.
"""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="bubbletea report",
        description=DESCRIPTION,
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("run_dir", metavar="RUN_DIR", type=Path, help="the run folder (contains summary.json)")
    parser.add_argument(
        "--out",
        metavar="DIR",
        type=Path,
        default=None,
        help="write the report here instead of into RUN_DIR (created if missing)",
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    """Print the comparison table and the files written; 2 (with "bubbletea: error: ...") on a bad folder."""
    args = build_parser().parse_args(argv)
    try:
        import matplotlib  # noqa: F401  (an optional dependency: the service image leaves it out)
    except ImportError:
        print(
            "bubbletea: error: bubbletea report draws with matplotlib, which is not installed here: "
            "pip install 'bubbletea[report]' (make install sets it up)",
            file=sys.stderr,
        )
        return 2
    try:
        folder = load_run_folder(args.run_dir)
        written = write_folder_report(folder, args.out if args.out is not None else folder.path)
    except ReportError as e:
        print(f"bubbletea: error: {e}", file=sys.stderr)
        return 2
    print(markdown_table(folder.summary))
    print("wrote:")
    for path in written:
        print(f"  {path}")
    return 0
