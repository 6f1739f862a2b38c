"""Child processes that do not outlive their launcher, and a Ctrl-C that is not lost while one starts."""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator

#: The signals a command is stopped with; held while a child is forked (`signals_held`).
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


def die_with_parent() -> None:
    """Run in a child before exec: ask Linux to SIGTERM it when its parent dies, so a launcher
    killed with SIGKILL (or a crashed test run) leaves no redis-server or service behind.
    A no-op where prctl is unavailable. Also lets the child have the stop signals its parent
    held while it forked (`signals_held`): a blocked signal mask is inherited."""
    signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)
    with contextlib.suppress(Exception):
        import ctypes

        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        PR_SET_PDEATHSIG = 1
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


@contextlib.contextmanager
def signals_held() -> Iterator[None]:
    """Hold Ctrl-C and SIGTERM while a child is forked with a `preexec_fn`, outside an event loop.
    The interpreter runs its at-fork handlers then (logging's lock among them), and the
    KeyboardInterrupt a Ctrl-C raises inside one is printed as "Exception ignored" and lost: the
    command went on as if never interrupted. Held, the signal arrives when the fork is done, and
    raises there. Only the main thread has Python's signal handlers, so only it holds them."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    old = signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)
