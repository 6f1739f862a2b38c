"""A bench's child processes: started so that a Ctrl-C is the parent's, stopped however they end,
and a SIGTERM taken as Ctrl-C so every `finally` runs."""

from __future__ import annotations

import multiprocessing as mp
import signal
from collections.abc import Callable
from multiprocessing.process import BaseProcess
from typing import Any


def _terminate(signum: int, _frame: Any) -> None:
    raise SystemExit(128 + signum)  # unwinds through every `finally`: children and servers stop


def stop_on_sigterm() -> None:
    """A SIGTERM stops the bench as Ctrl-C does: every `finally` runs (children, redis-servers)."""
    signal.signal(signal.SIGTERM, _terminate)


def spawn_child(target: Callable[..., None], args: tuple[Any, ...], name: str) -> BaseProcess:
    """A daemon process (spawned: torch + fork is unsafe), started with SIGINT ignored: a Ctrl-C is
    the parent's to handle (it stops the child), not a traceback from the child's imports."""
    proc = mp.get_context("spawn").Process(target=target, args=args, name=name, daemon=True)
    sigint = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        proc.start()
    finally:
        signal.signal(signal.SIGINT, sigint)
    return proc


def stop_child(proc: BaseProcess, wait_s: float = 10.0) -> None:
    """Wait up to `wait_s` for `proc` to end, then terminate it, then kill it."""
    proc.join(wait_s)
    if proc.is_alive():
        proc.terminate()
        proc.join(5)
    if proc.is_alive():
        proc.kill()
        proc.join()
