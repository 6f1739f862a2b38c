"""The `bubbletea` and `loadgen` commands as a new user meets them (issue 37): the real entry points
in a subprocess; every everyday mistake gives one line, a non-zero exit and no traceback."""

from __future__ import annotations

import os
import subprocess
import sys
from importlib.metadata import version
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration
ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent


def run(*args: str, env: dict[str, str] | None = None, tool: str = "bubbletea") -> subprocess.CompletedProcess[str]:
    """`tool ARGS` as a user runs it: the installed script, this checkout's directory, no REDIS_URL."""
    base = {k: v for k, v in os.environ.items() if not k.startswith("BUBBLETEA_") and k != "REDIS_URL"}
    return subprocess.run(
        [str(BIN / tool), *args], env={**base, **(env or {})}, capture_output=True, text=True, timeout=120, cwd=ROOT
    )


def one_line_error(r: subprocess.CompletedProcess[str], line: str, code: int = 2) -> None:
    """Exit `code`, no traceback, and `line` as the last line on stderr."""
    assert r.returncode == code, (r.returncode, r.stderr[-2000:])
    assert "Traceback" not in r.stderr, r.stderr[-2000:]
    assert r.stderr.strip().splitlines()[-1] == line, r.stderr[-2000:]


@pytest.mark.parametrize("tool", ["bubbletea", "loadgen"])
def test_version_is_the_installed_distributions(tool: str) -> None:
    r = run("--version", tool=tool)
    assert r.returncode == 0 and r.stdout == f"{tool} {version('bubbletea')}\n"
