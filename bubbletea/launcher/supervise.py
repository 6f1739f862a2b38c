"""`bubbletea up`'s supervisor: restart a dead service; a dead stage worker too when the run can recover.

Once everything is up, `Supervisor.follow` watches every process until Ctrl-C/SIGTERM (the caller
cancels it), a failure it cannot fix, or the end of a finite run:

* a stateless service (every service not started per slot: the front door, the dispatcher, the
  WAN broker, the decoder) that exits, whatever its exit code, is restarted with the same
  environment and label (the front door keeps its port) after the backoff the restart policy
  (`shared.policies.restarts`) says, and waited on until healthy again. Its state lives in Redis
  (queued requests, pending stream entries, answers), so a new instance carries on. One line says
  so: ``==> dispatcher died (exit code -9); restarting in 0.5s (restart 1)``, then
  ``==> dispatcher restarted (pid N): healthy``. When the policy gives up (a crash loop), everything
  stops with a message naming the service and its last lines;
* a stage worker that exits with an error is restarted the same way when the run checkpoints
  (`training.checkpoint_every` > 0): the new process takes the free slot and the run resumes from
  its newest checkpoint (services/stage_worker/recovery.py). Without checkpoints a lost worker
  stops the run (its peers abort), so it stops everything, naming the worker;
* a process that exits with `EXIT_CONFIG` (2: it cannot run with this configuration, e.g. a
  checkpoint that cannot be loaded) is never restarted: everything stops, naming it;
* when every stage worker exited 0 (a finite run trained all its iterations) it returns 0.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable

from bubbletea.launcher.procs import Proc, ServiceFailed
from shared.policies.restarts import DEFAULT_POLICY, Death, GiveUp, RestartPolicy, decide
from shared.service import EXIT_CONFIG

#: How often child exit codes are polled: a death is noticed within this.
POLL_S = 0.2
#: How long a dead process's output gets to drain into its log before the new one starts.
DRAIN_S = 5.0


def restartable(p: Proc, *, workers: bool) -> bool:
    """Whether `up` restarts this process when it exits: every service but the stage workers, and
    (`workers`: the run recovers from a lost worker) a stage worker that exits with an error."""
    if not p.svc.per_slot:
        return True
    return workers and p.proc.returncode != 0


class Supervisor:
    """Watches `procs` (a list the caller also stops: a restarted process replaces its dead one in
    it). `respawn(dead)` starts a process like the dead one; `healthy(new)` returns once it is
    healthy, or once it died again (the next poll sees that death), and raises `ServiceFailed`
    if it is neither within its own timeout."""

    def __init__(
        self,
        procs: list[Proc],
        *,
        respawn: Callable[[Proc], Awaitable[Proc]],
        healthy: Callable[[Proc], Awaitable[None]],
        say: Callable[[str], None],
        policy: RestartPolicy = DEFAULT_POLICY,
        clock: Callable[[], float] = time.monotonic,
        restart_workers: bool = False,
    ) -> None:
        self.procs = procs
        self.restart_workers = restart_workers
        self.respawn, self.healthy, self.say = respawn, healthy, say
        self.policy, self.clock = policy, clock
        self.deaths: dict[str, list[Death]] = {}
        self._restarting: dict[int, asyncio.Task[None]] = {}

    @property
    def restarts(self) -> int:
        """How many restarts were started so far, over every service."""
        return sum(len(d) for d in self.deaths.values())

    async def follow(self) -> int:
        """Until cancelled, a failure (raised as `ServiceFailed`), or the end of training (0)."""
        try:
            while True:
                for task in [t for t in self._restarting.values() if t.done()]:
                    task.result()  # a restart that failed (never healthy) fails the whole run
                for i, p in enumerate(self.procs):
                    if p.proc.returncode is None or i in self._restarting:
                        continue
                    if p.proc.returncode == EXIT_CONFIG:  # the same every time: a restart cannot help
                        raise ServiceFailed(
                            f"{p.label} (pid {p.proc.pid}) cannot run with this configuration (exit code "
                            f"{EXIT_CONFIG}); not restarting; last output:\n" + "\n".join(p.tail)
                        )
                    if restartable(p, workers=self.restart_workers):
                        self._on_death(i, p)
                    elif p.proc.returncode != 0:
                        raise ServiceFailed(
                            f"{p.label} (pid {p.proc.pid}) exited with code {p.proc.returncode}; stage workers are "
                            "not restarted in a run without checkpoints (training.checkpoint_every: 0); last output:\n"
                            + "\n".join(p.tail)
                        )
                workers = [p for p in self.procs if p.svc.per_slot]
                if workers and all(p.proc.returncode == 0 for p in workers):
                    self.say("==> training finished: every worker completed its iterations; stopping")
                    return 0
                await asyncio.sleep(POLL_S)  # polling child exit codes: there is no event for all of them
        finally:
            for task in self._restarting.values():
                task.cancel()
            await asyncio.gather(*self._restarting.values(), return_exceptions=True)

    def _on_death(self, i: int, p: Proc) -> None:
        now = self.clock()
        deaths = self.deaths.setdefault(p.label, [])
        deaths.append(Death(p.started, now))
        verdict = decide(deaths, now, self.policy)
        code = p.proc.returncode
        if isinstance(verdict, GiveUp):
            raise ServiceFailed(
                f"{p.label} (pid {p.proc.pid}) died (exit code {code}) and {verdict.reason}; last output:\n"
                + "\n".join(p.tail)
            )
        self.say(
            f"==> {p.label} died (exit code {code}); restarting in {verdict.delay_s:g}s (restart {verdict.attempt})"
        )
        self._restarting[i] = asyncio.create_task(self._restart(i, p, verdict.delay_s), name=f"restart:{p.label}")

    async def _restart(self, i: int, dead: Proc, delay_s: float) -> None:
        await asyncio.sleep(delay_s)  # the policy's backoff
        if dead.pump is not None:  # its last lines into its log (and tail) before the new one appends
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(asyncio.gather(dead.pump, return_exceptions=True), DRAIN_S)
        new = await self.respawn(dead)
        self.procs[i] = new  # at once: a stop from now on stops the new process
        await self.healthy(new)
        if new.proc.returncode is None:
            self.say(f"==> {new.label} restarted (pid {new.proc.pid}): healthy")
        del self._restarting[i]  # from now on its exit is a death again
