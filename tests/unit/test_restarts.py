"""The restart policy on a fake clock: backoff doubling to its cap, reset by a stable life, and
giving up on a crash loop; and `up`'s supervisor applying it to fake processes."""

from __future__ import annotations

import asyncio
import itertools
from collections import deque
from typing import Any

import pytest

from bubbletea.launcher import supervise
from bubbletea.launcher.procs import Proc, ServiceFailed
from bubbletea.launcher.services import DISPATCHER, STAGE_WORKER, ServiceDef
from shared.policies.restarts import (
    BACKOFF_INITIAL_S,
    BACKOFF_MAX_S,
    EXIT_CONFIG,
    MAX_DEATHS_IN_WINDOW,
    STABLE_AFTER_S,
    WINDOW_S,
    Death,
    Exited,
    Finished,
    GiveUp,
    Replace,
    Restart,
    RestartPolicy,
    decide,
    on_exit,
)


class Clock:
    """A fake clock and a supervised process on it: lives, dies, is restarted after the delay."""

    def __init__(self, policy: RestartPolicy | None = None) -> None:
        self.now = 1000.0
        self.started = self.now
        self.deaths: list[Death] = []
        self.policy = policy or RestartPolicy()

    def die_after(self, lived_s: float) -> Restart | GiveUp:
        self.now = self.started + lived_s
        self.deaths.append(Death(self.started, self.now))
        verdict = decide(self.deaths, self.now, self.policy)
        if isinstance(verdict, Restart):
            self.now += verdict.delay_s
            self.started = self.now
        return verdict


def test_the_constants_are_the_documented_ones() -> None:
    assert (BACKOFF_INITIAL_S, BACKOFF_MAX_S, STABLE_AFTER_S) == (0.5, 10.0, 30.0)
    assert (MAX_DEATHS_IN_WINDOW, WINDOW_S) == (5, 60.0)


def test_backoff_doubles_up_to_its_cap() -> None:
    # a generous window: only the backoff is under test here
    c = Clock(RestartPolicy(max_deaths_in_window=100))
    delays = []
    for _ in range(8):
        v = c.die_after(1.0)
        assert isinstance(v, Restart)
        delays.append(v.delay_s)
    assert delays == [0.5, 1.0, 2.0, 4.0, 8.0, 10.0, 10.0, 10.0]


def test_attempts_count_every_restart() -> None:
    c = Clock()
    attempts = [v.attempt for v in (c.die_after(STABLE_AFTER_S + 1) for _ in range(4)) if isinstance(v, Restart)]
    assert attempts == [1, 2, 3, 4]


def test_a_stable_life_resets_the_backoff() -> None:
    c = Clock(RestartPolicy(max_deaths_in_window=100))
    for _ in range(4):
        c.die_after(1.0)  # 0.5, 1, 2, 4
    v = c.die_after(STABLE_AFTER_S)  # it ran stably this time
    assert v == Restart(BACKOFF_INITIAL_S, 5)
    v = c.die_after(1.0)  # a short life right after a stable one: the doubling starts over
    assert v == Restart(BACKOFF_INITIAL_S, 6)
    v = c.die_after(1.0)
    assert v == Restart(2 * BACKOFF_INITIAL_S, 7)


def test_a_crash_loop_gives_up_on_the_death_past_the_limit() -> None:
    c = Clock()
    for _ in range(MAX_DEATHS_IN_WINDOW):
        assert isinstance(c.die_after(0.1), Restart)  # 0.5+1+2+4 s of backoff: all within the window
    v = c.die_after(0.1)
    assert isinstance(v, GiveUp)
    assert f"died {MAX_DEATHS_IN_WINDOW + 1} times within 60s" in v.reason


def test_deaths_spread_beyond_the_window_do_not_give_up() -> None:
    c = Clock()
    for _ in range(3 * MAX_DEATHS_IN_WINDOW):
        v = c.die_after(WINDOW_S / MAX_DEATHS_IN_WINDOW + 1)  # at most 5 deaths in any 60 s
        assert isinstance(v, Restart), v


def test_only_deaths_within_the_window_count() -> None:
    old = [Death(float(t), float(t) + 0.1) for t in range(5)]  # five deaths long ago
    now = 10_000.0
    assert isinstance(decide([*old, Death(now - 1, now)], now), Restart)
    assert isinstance(decide([Death(now - 1 - t, now - t) for t in range(6)], now), GiveUp)


def test_decide_needs_a_death() -> None:
    with pytest.raises(ValueError):
        decide([], 0.0)


# --- the supervisor, over fake processes ---------------------------------------------------------

_pids = itertools.count(100)


ONE = [Death(0.0, 100.0)]  # a first death, after a stable life


def test_which_exits_are_restarted() -> None:
    """`on_exit`: a configuration that cannot run is never restarted; a worker that exits 0 has
    finished; a failed worker is restarted only when the run recovers; any other exit backs off."""
    for worker in (False, True):
        for recoverable in (False, True):
            v = on_exit(Exited(EXIT_CONFIG, worker), ONE, 100.0, recoverable=recoverable)
            assert isinstance(v, GiveUp) and "cannot run with this configuration (exit code 2)" in v.reason
    for recoverable in (False, True):
        assert on_exit(Exited(0, worker=True), ONE, 100.0, recoverable=recoverable) == Finished()
        # a worker that left a run that goes on (a drain): replaced at once, no death
        assert on_exit(Exited(0, worker=True, left=True), ONE, 100.0, recoverable=recoverable) == Replace()
    lost = on_exit(Exited(-9, worker=True), ONE, 100.0, recoverable=False)
    assert isinstance(lost, GiveUp) and "not restarted in a run without checkpoints" in lost.reason
    assert on_exit(Exited(-9, worker=True), ONE, 100.0, recoverable=True) == Restart(BACKOFF_INITIAL_S, 1)
    for code in (0, 1, -9):  # a stateless service: whatever its exit code
        assert on_exit(Exited(code, worker=False), ONE, 100.0, recoverable=False) == Restart(BACKOFF_INITIAL_S, 1)
    loop = [Death(t, t + 1.0) for t in range(0, 12, 2)]  # six short lives within 12 s
    crash = on_exit(Exited(1, worker=False), loop, 12.0, recoverable=False)
    assert isinstance(crash, GiveUp) and crash.reason.startswith("died (exit code 1) and died 6 times within 60s")


class FakeProcess:
    def __init__(self, returncode: int | None = None) -> None:
        self.pid = next(_pids)
        self.returncode = returncode


def fake(svc: ServiceDef, label: str, returncode: int | None = None) -> Proc:
    p: Any = FakeProcess(returncode)
    return Proc(svc, p, label=label, tail=deque(["last line of " + label]))


FAST = RestartPolicy(backoff_initial_s=0.0, backoff_max_s=0.0)


def supervisor(procs: list[Proc], *, respawn_code: int | None, lines: list[str]) -> supervise.Supervisor:
    async def respawn(dead: Proc) -> Proc:
        return fake(dead.svc, dead.label, respawn_code)

    async def healthy(p: Proc) -> None:
        return None

    return supervise.Supervisor(procs, respawn=respawn, healthy=healthy, say=lines.append, policy=FAST)


@pytest.fixture(autouse=True)
def fast_polls(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(supervise, "POLL_S", 0.001)


async def test_a_dead_dispatcher_is_restarted_in_place_with_a_line_saying_so() -> None:
    procs = [fake(DISPATCHER, "dispatcher", returncode=-9), fake(STAGE_WORKER, "stage_worker-0")]
    lines: list[str] = []
    sup = supervisor(procs, respawn_code=None, lines=lines)
    task = asyncio.create_task(sup.follow())
    async with asyncio.timeout(5):
        while not any("restarted" in line for line in lines):  # noqa: ASYNC110
            await asyncio.sleep(0.001)  # polling the fake supervisor's output
    assert lines[0] == "==> dispatcher died (exit code -9); restarting in 0s (restart 1)"
    assert procs[0].proc.returncode is None and procs[0].label == "dispatcher"  # the new one, in place
    procs[1].proc.returncode = 0  # training finished
    assert await asyncio.wait_for(task, 5) == 0


async def test_a_crash_loop_stops_everything_naming_the_service_and_its_last_lines() -> None:
    procs = [fake(DISPATCHER, "dispatcher", returncode=1), fake(STAGE_WORKER, "stage_worker-0")]
    lines: list[str] = []
    with pytest.raises(ServiceFailed, match=r"dispatcher \(pid \d+\) died \(exit code 1\) and died 6 times") as e:
        await asyncio.wait_for(supervisor(procs, respawn_code=1, lines=lines).follow(), 5)
    assert "last line of dispatcher" in str(e.value)
    assert len([line for line in lines if "died" in line]) == MAX_DEATHS_IN_WINDOW


async def test_a_dead_worker_of_a_run_without_checkpoints_is_not_restarted_and_stops_everything() -> None:
    procs = [fake(DISPATCHER, "dispatcher"), fake(STAGE_WORKER, "stage_worker-1", returncode=1)]
    with pytest.raises(ServiceFailed, match=r"stage_worker-1 \(pid \d+\) exited with code 1; stage workers are not"):
        await asyncio.wait_for(supervisor(procs, respawn_code=None, lines=[]).follow(), 5)


async def test_a_dead_worker_of_a_run_that_checkpoints_is_restarted() -> None:
    procs = [fake(DISPATCHER, "dispatcher"), fake(STAGE_WORKER, "stage_worker-1", returncode=-9)]
    lines: list[str] = []
    sup = supervisor(procs, respawn_code=None, lines=lines)
    sup.restart_workers = True
    task = asyncio.create_task(sup.follow())
    async with asyncio.timeout(5):
        while not any("restarted" in line for line in lines):  # noqa: ASYNC110
            await asyncio.sleep(0.001)  # polling the fake supervisor's output
    assert lines[0] == "==> stage_worker-1 died (exit code -9); restarting in 0s (restart 1)"
    procs[1].proc.returncode = 0  # the new one finished training: not a death
    assert await asyncio.wait_for(task, 5) == 0


async def test_a_service_that_cannot_run_with_its_configuration_is_never_restarted() -> None:
    """Exit code 2 (a checkpoint that cannot be loaded, a device that is not there) is the same every time."""
    procs = [fake(DISPATCHER, "dispatcher"), fake(STAGE_WORKER, "stage_worker-0", returncode=2)]
    lines: list[str] = []
    sup = supervisor(procs, respawn_code=None, lines=lines)
    sup.restart_workers = True
    with pytest.raises(ServiceFailed, match=r"stage_worker-0 \(pid \d+\) cannot run with this configuration"):
        await asyncio.wait_for(sup.follow(), 5)
    assert lines == []
