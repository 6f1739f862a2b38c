"""The compose tier's timings, printed at the end of the session (build, up to ready, the burst,
a crash to recovered, a spare's takeover): the figures a reader of `make test` wants to see."""

from __future__ import annotations

import pytest

from tests.compose.harness import TIMINGS


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if TIMINGS:
        shown = ", ".join(f"{k} {v}" for k, v in TIMINGS.items())
        terminalreporter.write_line(f"compose tier (a real Docker engine): {shown}")
