"""The Slurm tier's timings, printed at the end of the session (Slurm up, sbatch to the first
iteration, a cancelled step to the spare training, sbatch to trained, scancel to nothing left)."""

from __future__ import annotations

import pytest

from tests.slurm.harness import TIMINGS


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if TIMINGS:
        shown = ", ".join(f"{k} {v}" for k, v in TIMINGS.items())
        terminalreporter.write_line(f"slurm tier (a real slurmctld and slurmds): {shown}")
