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
    A no-op where prctl is unavailable."""
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
    command went on as if never interrupted. Held, a signal is only noted, and raised again once
    the fork is done, to the handler it was meant for. (Not a blocked signal mask: a process's
    other threads would still take the signal, and Python runs its handler in the main thread
    wherever it is.) The child's exec resets the handlers; only the main thread can set them."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    noted: list[int] = []
    previous = {sig: signal.signal(sig, lambda signum, _frame: noted.append(signum)) for sig in STOP_SIGNALS}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler if handler is not None else signal.SIG_DFL)  # None: set outside Python
        for signum in dict.fromkeys(noted):
            signal.raise_signal(signum)
