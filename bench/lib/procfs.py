"""What /proc says of a process a bench started: its command line, its CPU time."""

from __future__ import annotations

import os
from pathlib import Path


def command_words(pid: int) -> list[str] | None:
    """The command line of `pid` as words, None if it is gone. Split on NULs and on spaces: a stage
    worker forked by a launcher (`bubbletea/launcher/forked.py`) writes its command line as one
    string with spaces (setproctitle), an exec'd process has one NUL-separated argument each."""
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return None
    return raw.replace(b"\0", b" ").decode(errors="replace").split()


def cpu_seconds(pid: int) -> float | None:
    """User + system CPU seconds of `pid` (every thread of it, not its children); None if it is gone."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = raw[raw.rindex(")") + 2 :].split()  # after the command's name, which may hold spaces
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
