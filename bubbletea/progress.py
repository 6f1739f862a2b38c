"""Progress of long work (`demo`, `train`, the benchmarks): a bar on a terminal, plain lines elsewhere.

One decision, made here for every command: when the stream the work reports to is a terminal
(`on_terminal`), a tqdm bar shows the steps done, the total and the time left below the lines the
work prints; anywhere else (a pipe, a file, a test, CI) the same lines are printed exactly as they
always were and no bar is drawn, so logs and the tests that read them do not change.

    with StepBar(total=8, desc="training", out=sys.stdout) as bar:
        for ...:
            bar.line("iteration 3 ...")  # above the bar on a terminal, a plain line elsewhere
            bar.advance()

`ClockBar` is the same bar for work that reports no steps of its own (the device time scale's
measurement, done in other processes): it counts seconds against an estimate of the total and
fills at once when the work ends.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import sys
import time
from collections.abc import Awaitable
from typing import Any, Self, TextIO, TypeVar

from tqdm import tqdm

T = TypeVar("T")

#: Set to 0 to draw no bar even on a terminal.
ENV = "BUBBLETEA_PROGRESS"


def on_terminal(stream: TextIO) -> bool:
    """Whether `stream` gets a bar: a terminal that can redraw a line, unless `BUBBLETEA_PROGRESS=0`
    turns bars off."""
    if os.environ.get(ENV, "").strip() == "0" or os.environ.get("TERM") == "dumb":
        return False
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError, OSError):  # no isatty, or a closed stream
        return False


def say(text: str, out: TextIO = sys.stdout) -> None:
    """Print one line: above any bar drawn on `out` (tqdm clears and redraws it), else as `print`."""
    if on_terminal(out):
        tqdm.write(text, file=out)
        out.flush()
    else:
        print(text, file=out, flush=True)


class StepBar:
    """`total` steps of work reported on `out`: a bar there when it is a terminal, nothing drawn
    otherwise. `line` prints a line either way; `advance` moves the bar (never past `total`). With
    `out` None the work is silent: no line, no bar."""

    def __init__(
        self, total: int, desc: str, out: TextIO | None = sys.stdout, unit: str = "it", bar_format: str | None = None
    ) -> None:
        self.out, self.total, self.done = out, max(0, total), 0
        self.bar: tqdm[Any] | None = None
        if out is not None and on_terminal(out):
            self.bar = tqdm(
                total=self.total,
                desc=desc,
                unit=unit,
                file=out,
                leave=False,
                dynamic_ncols=True,
                bar_format=bar_format,
            )

    def line(self, text: str) -> None:
        if self.out is not None:
            say(text, self.out)

    def advance(self, steps: int = 1) -> None:
        steps = min(steps, self.total - self.done)
        if steps <= 0:
            return
        self.done += steps
        # not drawn by update (tqdm's minimum interval): drawn anyway, as steps are seconds apart
        if self.bar is not None and not self.bar.update(steps):
            self.bar.refresh()

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    async def __aenter__(self) -> Self:  # beside async context managers in one `async with`
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.close()


class ClockBar(StepBar):
    """A bar in seconds for work that reports no steps: it advances with the clock towards
    `estimate_s` (held one second short of it while the work goes on) and fills when the work ends."""

    def __init__(self, estimate_s: float, desc: str, out: TextIO = sys.stdout) -> None:
        # seconds done/estimated and the time left; no rate ("1.0s/s" says nothing)
        fmt = "{desc}: {percentage:3.0f}%|{bar}| {n_fmt}/{total_fmt} s [{elapsed}<{remaining}]"
        super().__init__(max(1, round(estimate_s)), desc, out, unit="s", bar_format=fmt)

    async def run(self, work: Awaitable[T], tick_s: float = 0.5) -> T:
        """Await `work`, moving the bar with the clock meanwhile (not at all when none is drawn)."""
        if self.bar is None:
            return await work
        start = time.monotonic()

        async def tick() -> None:
            while True:
                await asyncio.sleep(tick_s)
                self.advance(min(int(time.monotonic() - start), self.total - 1) - self.done)

        ticker = asyncio.create_task(tick())
        try:
            result = await work
        finally:
            ticker.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await ticker
        self.advance(self.total - self.done)
        return result
