"""`bubbletea.progress`: a bar with done/total and the time left on a terminal, today's plain lines elsewhere."""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import io
import os
import re
import struct
import subprocess
import sys
import termios
import textwrap
from pathlib import Path

from bubbletea.launcher.train import _report_iteration
from bubbletea.progress import ClockBar, StepBar, on_terminal, say

ROOT = Path(__file__).resolve().parents[2]


def run_on_a_pty(argv: list[str], env: dict[str, str] | None = None, timeout: float = 60) -> tuple[int, str]:
    """Run `argv` with its stdout and stderr on a pseudo-terminal of 100 columns: its exit code and
    all it wrote."""
    master, slave = os.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 30, 100, 0, 0))  # a new pty is 0 x 0
    proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=slave, stderr=slave, cwd=ROOT, env=env)
    os.close(slave)
    chunks = []
    try:
        while True:
            try:
                data = os.read(master, 65536)
            except OSError:  # EIO: every writer closed the terminal
                break
            if not data:
                break
            chunks.append(data)
    finally:
        os.close(master)
    return proc.wait(timeout=timeout), b"".join(chunks).decode("utf-8", "replace")


def test_not_on_a_terminal_the_lines_are_todays_and_no_bar_is_drawn() -> None:
    out = io.StringIO()
    with StepBar(3, "training", out) as bar:
        _report_iteration(bar, None, {"iteration": 0, "loss": 5.5, "seconds": 0.25, "tokens_per_s": 1024.0})
        bar.advance()
        bar.line("saved iteration 0 to x")
        bar.advance(5)  # never past the total
    assert out.getvalue() == (
        "iteration    0  loss 5.5000  time    250.0 ms       1024 tokens/s\nsaved iteration 0 to x\n"
    )
    assert bar.done == 3 and not on_terminal(out)
    say("a line", out)
    assert out.getvalue().endswith("\na line\n")


def test_a_silent_bar_prints_nothing() -> None:
    with StepBar(2, "x", None) as bar:
        bar.line("nothing")
        bar.advance()
    assert bar.done == 1


def test_the_clock_bar_off_a_terminal_only_awaits_the_work() -> None:
    out = io.StringIO()

    async def work() -> int:
        await asyncio.sleep(0.01)
        return 7

    with ClockBar(3.0, "measuring", out) as bar:
        assert asyncio.run(bar.run(work())) == 7
    assert out.getvalue() == ""


SCRIPT = textwrap.dedent(
    """
    import asyncio, sys, time
    from bubbletea.progress import ClockBar, StepBar
    with StepBar(3, "training", sys.stdout) as bar:
        for i in range(3):
            time.sleep(0.3)
            bar.line(f"iteration {i}")
            bar.advance()
    with ClockBar(2.0, "measuring", sys.stdout) as clock:
        asyncio.run(clock.run(asyncio.sleep(1.2), tick_s=0.1))
    print("done", flush=True)
    """
)


def test_on_a_terminal_a_bar_shows_done_total_and_time_left() -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("BUBBLETEA_PROGRESS",)}
    env["TERM"] = "xterm"
    code, text = run_on_a_pty([sys.executable, "-c", SCRIPT], env)
    assert code == 0, text
    for i in range(3):
        assert f"iteration {i}\r\n" in text or f"iteration {i}\n" in text  # the lines, above the bar
    assert re.search(r"training: +\d+%\|.*\| 2/3 \[\d\d:\d\d<\d\d:\d\d", text), text  # done/total, elapsed<left
    assert re.search(r"measuring: .*\| 1/2 s \[\d\d:\d\d<\d\d:\d\d\]", text), text  # seconds of the estimate
    assert text.rstrip().endswith("done")


def test_bubbletea_progress_0_turns_the_bar_off_on_a_terminal() -> None:
    env = {**os.environ, "TERM": "xterm", "BUBBLETEA_PROGRESS": "0"}
    code, text = run_on_a_pty([sys.executable, "-c", SCRIPT], env)
    assert code == 0, text
    assert "training:" not in text and "iteration 2" in text


def test_a_bar_goes_beside_async_context_managers_in_one_async_with() -> None:
    """bench/sim_vs_live.py: `async with EmbeddedRedis() as server, StepBar(...) as bar:`."""
    out = io.StringIO()

    async def run() -> StepBar:
        async with contextlib.AsyncExitStack(), StepBar(2, "cases", out) as bar:
            bar.line("case 1")
            bar.advance()
        return bar

    bar = asyncio.run(run())
    assert bar.done == 1 and bar.bar is None and out.getvalue() == "case 1\n"
