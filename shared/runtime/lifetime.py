"""Child processes that do not outlive their launcher."""

from __future__ import annotations

import contextlib
import signal


def die_with_parent() -> None:
    """Run in a child before exec: ask Linux to SIGTERM it when its parent dies, so a launcher
    killed with SIGKILL (or a crashed test run) leaves no redis-server or service behind.
    A no-op where prctl is unavailable."""
    with contextlib.suppress(Exception):
        import ctypes

        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        PR_SET_PDEATHSIG = 1
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
