"""What the bench scripts share (not a benchmark: `make bench` skips bench/_*.py).

A script in bench/ imports it as ``import _common`` (Python puts the script's own folder first on
``sys.path``, so ``python bench/<name>.py`` finds it from any working directory).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import signal
import sys
from collections.abc import Callable, Collection
from multiprocessing.process import BaseProcess
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
MIB = 1 << 20
#: Warm-up transfers or fetches before the timed ones (checked, not timed).
WARMUP = 2


def command_words(pid: int) -> list[str] | None:
    """The command line of `pid` as words, None if it is gone. Split on NULs and on spaces: a stage
    worker forked by a launcher (`bubbletea/launcher/forked.py`) writes its command line as one
    string with spaces (setproctitle), an exec'd process has one NUL-separated argument each."""
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return None
    return raw.replace(b"\0", b" ").decode(errors="replace").split()


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


def verdict(problems: list[str], ok: str) -> dict[str, Any]:
    """``valid`` and ``why``: `ok` when nothing went wrong, else the problems (the first three)."""
    if not problems:
        return {"valid": True, "why": ok}
    more = f" (and {len(problems) - 3} more)" if len(problems) > 3 else ""
    return {"valid": False, "why": "; ".join(problems[:3]) + more}


def emit(result: dict[str, Any]) -> None:
    """The bench's one JSON line, last on stdout."""
    print(json.dumps(result), flush=True)


def stderr(*parts: Any) -> None:
    print(*parts, file=sys.stderr, flush=True)


def arms_of(p: argparse.ArgumentParser, value: str, known: Collection[str]) -> list[str]:
    """The arms named in `--arms` (comma-separated, in order); a name not `known` is a usage error."""
    arms = [a.strip() for a in value.split(",") if a.strip()]
    if bad := [a for a in arms if a not in known]:
        p.error(f"--arms: unknown {', '.join(bad)} (choose from {', '.join(known)})")
    return arms
