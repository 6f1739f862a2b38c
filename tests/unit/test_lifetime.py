"""A Ctrl-C while a child is forked is held until the fork is done, not lost (shared/runtime/lifetime.py)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

from shared.runtime.lifetime import die_with_parent, signals_held


def test_a_ctrl_c_during_the_hold_is_raised_when_it_ends() -> None:
    # a command's own handler (a pytest-xdist worker ignores SIGINT)
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    reached_the_end_of_the_block = False
    try:
        with pytest.raises(KeyboardInterrupt), signals_held():
            os.kill(os.getpid(), signal.SIGINT)
            reached_the_end_of_the_block = True  # not raised inside: held
    finally:
        signal.signal(signal.SIGINT, previous)
    assert reached_the_end_of_the_block


def test_a_child_forked_during_the_hold_gets_the_stop_signals() -> None:
    """The hold leaves nothing blocked or ignored that a child inherits: a redis-server started in
    it still stops on SIGTERM and SIGINT."""
    with signals_held():
        out = subprocess.run(
            [sys.executable, "-c", "print(open('/proc/self/status').read())"],
            preexec_fn=die_with_parent,
            capture_output=True,
            text=True,
            check=True,
        ).stdout
    for field in ("SigBlk:", "SigIgn:"):
        mask = int(next(line for line in out.splitlines() if line.startswith(field)).split()[1], 16)
        for sig in (signal.SIGINT, signal.SIGTERM):
            assert not mask & (1 << (sig - 1)), f"{sig.name} in the child's {field}"
