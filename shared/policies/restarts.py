"""Restart policy (pure): when a supervised process exits, restart it after how long, or give up.

`bubbletea up` supervises every process it starts. When one exits it feeds `on_exit` the exit
(code, and whether it is a stage worker), the service's death history and the clock, and gets back
a value: `Restart` (after `delay_s`), `GiveUp` (stop everything, with the reason) or `Finished` (a
stage worker that trained all its iterations: nothing to do). No I/O, no clock of its own: the
caller passes `now`, so a test drives it with a fake clock.

Which exits are restarted (`on_exit`):

* exit code `EXIT_CONFIG` (2: the process cannot run with this configuration, e.g. a checkpoint
  that cannot be loaded): never, whatever the service; the next start would fail the same way;
* a stage worker that exits 0 completed its iterations: `Finished`;
* a stage worker that fails is restarted only when the run can recover (it checkpoints: the new
  process takes the free slot and resumes); without checkpoints its peers abort, so give up;
* any other exit of any service (the stateless ones keep their state in Redis): the backoff rules.

The backoff rules (`decide`; constants below):

* Backoff: the first restart after a stable life waits `BACKOFF_INITIAL_S`; each further death in
  a row of short lives doubles it, up to `BACKOFF_MAX_S` (0.5, 1, 2, 4, 8, 10, 10 ... s).
* Stability resets the backoff: a process that ran at least `STABLE_AFTER_S` before dying starts
  the doubling over (its death waits `BACKOFF_INITIAL_S` again).
* Giving up: more than `MAX_DEATHS_IN_WINDOW` deaths within the last `WINDOW_S` seconds (the
  death being decided included) is a crash loop no restart will fix: stop everything and say so.

No jitter: each service is one local process restarted by one supervisor, so there is no herd of
clients to spread out, and a deterministic delay is easier to read in the log and to test.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

#: The exit code of a process that cannot run with its configuration: restarting cannot help.
EXIT_CONFIG = 2

#: The delay before the first restart (and after a stable life).
BACKOFF_INITIAL_S = 0.5
#: Each death in a row of short lives multiplies the delay by this.
BACKOFF_FACTOR = 2.0
#: The longest delay.
BACKOFF_MAX_S = 10.0
#: A process that lived at least this long was stable: its death restarts the backoff.
STABLE_AFTER_S = 30.0
#: Give up when a service died more than this many times ...
MAX_DEATHS_IN_WINDOW = 5
#: ... within this many seconds.
WINDOW_S = 60.0


@dataclass(frozen=True)
class RestartPolicy:
    backoff_initial_s: float = BACKOFF_INITIAL_S
    backoff_factor: float = BACKOFF_FACTOR
    backoff_max_s: float = BACKOFF_MAX_S
    stable_after_s: float = STABLE_AFTER_S
    max_deaths_in_window: int = MAX_DEATHS_IN_WINDOW
    window_s: float = WINDOW_S


DEFAULT_POLICY = RestartPolicy()


@dataclass(frozen=True)
class Death:
    """One death of a service's process: when that process started and when it died (same clock)."""

    started: float
    died: float

    @property
    def lived_s(self) -> float:
        return self.died - self.started


@dataclass(frozen=True)
class Restart:
    """Restart the service after `delay_s`; this is its `attempt`-th restart (1-based, all time)."""

    delay_s: float
    attempt: int


@dataclass(frozen=True)
class GiveUp:
    """Do not restart: stop everything; `reason` says why (a crash loop, a configuration that
    cannot run, a worker lost in a run that cannot recover)."""

    reason: str


@dataclass(frozen=True)
class Finished:
    """A stage worker that exited 0: it trained all its iterations. Not a death."""


@dataclass(frozen=True)
class Exited:
    """A supervised process exited with `code`; `worker`: it is a stage worker (one per slot);
    `left`: a worker that left a run that goes on (drained: its slot marked `left`)."""

    code: int
    worker: bool
    left: bool = False


@dataclass(frozen=True)
class Replace:
    """Start a replacement at once: a worker left on purpose (a drain), which is no death."""


def on_exit(
    exited: Exited,
    deaths: Sequence[Death],
    now: float,
    *,
    recoverable: bool,
    policy: RestartPolicy = DEFAULT_POLICY,
) -> Restart | GiveUp | Finished | Replace:
    """What to do about a process that exited. `deaths`: its service's, oldest first, this exit
    last; `recoverable`: the run resumes from a checkpoint when it loses a worker."""
    if exited.code == EXIT_CONFIG:
        return GiveUp(f"cannot run with this configuration (exit code {EXIT_CONFIG}); not restarting")
    if exited.worker and exited.code == 0:
        return Replace() if exited.left else Finished()
    if exited.worker and not recoverable:
        return GiveUp(
            f"exited with code {exited.code}; stage workers are not restarted in a run without "
            "checkpoints (training.checkpoint_every: 0)"
        )
    verdict = decide(deaths, now, policy)
    if isinstance(verdict, GiveUp):
        return GiveUp(f"died (exit code {exited.code}) and {verdict.reason}")
    return verdict


def decide(deaths: Sequence[Death], now: float, policy: RestartPolicy = DEFAULT_POLICY) -> Restart | GiveUp:
    """What to do about the last of `deaths` (one service's, oldest first, at least one), at `now`."""
    if not deaths:
        raise ValueError("decide needs at least the death being decided")
    recent = [d for d in deaths if d.died > now - policy.window_s]
    if len(recent) > policy.max_deaths_in_window:
        return GiveUp(
            f"died {len(recent)} times within {policy.window_s:.0f}s "
            f"(more than {policy.max_deaths_in_window}): a crash loop, not restarting"
        )
    streak = 0  # deaths in a row, newest first, of processes that did not live stably
    for d in reversed(deaths):
        if d.lived_s >= policy.stable_after_s:
            break
        streak += 1
    delay = policy.backoff_initial_s * policy.backoff_factor ** max(streak - 1, 0)
    return Restart(delay_s=min(delay, policy.backoff_max_s), attempt=len(deaths))
