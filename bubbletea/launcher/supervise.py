"""`bubbletea up`'s supervisor: restart a dead service; a dead stage worker too when the run can recover.

Once everything is up, `Supervisor.follow` watches every process until Ctrl-C/SIGTERM (the caller
cancels it), a failure it cannot fix, or the end of a finite run. What to do about an exit is the
restart policy's decision (`shared.policies.restarts.on_exit`); this shell executes it:

* `Restart`: the process is started again with the same environment and label (the front door
  keeps its port) after the policy's backoff, and waited on until healthy again. A stateless
  service's state lives in Redis (queued requests, pending stream entries, answers), so a new
  instance carries on; a new stage worker takes the free slot and the run resumes from its newest
  checkpoint (services/stage_worker/membership/generations.py). One line says so:
  ``==> dispatcher died (exit code -9); restarting in 0.5s (restart 1)``, then
  ``==> dispatcher restarted (pid N): healthy``;
* `GiveUp` (a crash loop, exit code `EXIT_CONFIG`, a worker lost in a run without checkpoints):
  everything stops with a message naming the process, the reason and its last lines;
* `Finished`: a stage worker that trained all its iterations; when every worker has, `follow`
  returns 0.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable

from bubbletea.launcher.procs import Proc, ServiceFailed
from shared.policies.restarts import DEFAULT_POLICY, Death, Exited, Finished, GiveUp, Replace, RestartPolicy, on_exit

#: How often child exit codes are polled: a death is noticed within this.
POLL_S = 0.2
#: How long a dead process's output gets to drain into its log before the new one starts.
DRAIN_S = 5.0


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
        departed: Callable[[], Awaitable[bool]] | None = None,
        buried: Callable[[Proc], Awaitable[None]] | None = None,
    ) -> None:
        self.procs = procs
        #: Called for a process that died, before its restart: a dead stage worker's lease is
        #: released at once (its peers and its replacement need not wait for it to expire).
        self.buried = buried
        #: Whether some worker left the run on purpose (a drain): one that exits 0 then is replaced.
        self.departed = departed
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
                    if p.proc.returncode is not None and i not in self._restarting:
                        left = p.svc.per_slot and p.proc.returncode == 0 and await self._departed()
                        self._on_exit(i, p, left=left)
                workers = [p for p in self.procs if p.svc.per_slot]
                if workers and all(p.proc.returncode == 0 for p in workers):
                    self.say("==> training finished: every worker completed its iterations; stopping")
                    return 0
                await asyncio.sleep(POLL_S)  # polling child exit codes: there is no event for all of them
        finally:
            for task in self._restarting.values():
                task.cancel()
            await asyncio.gather(*self._restarting.values(), return_exceptions=True)

    async def _departed(self) -> bool:
        return self.departed is not None and await self.departed()

    def _on_exit(self, i: int, p: Proc, *, left: bool = False) -> None:
        code = p.proc.returncode
        assert code is not None
        now = self.clock()
        deaths = [*self.deaths.get(p.label, []), Death(p.started, now)]
        exited = Exited(code, worker=p.svc.per_slot, left=left)
        verdict = on_exit(exited, deaths, now, recoverable=self.restart_workers, policy=self.policy)
        if isinstance(verdict, Finished):
            return  # not a death: `follow` ends once every worker has finished
        if isinstance(verdict, Replace):  # no death: no backoff, no crash-loop count
            self.say(f"==> {p.label} left the run (drained); starting a replacement")
            self._restarting[i] = asyncio.create_task(self._restart(i, p, 0.0), name=f"replace:{p.label}")
            return
        self.deaths[p.label] = deaths
        if isinstance(verdict, GiveUp):
            raise ServiceFailed(f"{p.label} (pid {p.proc.pid}) {verdict.reason}; last output:\n" + "\n".join(p.tail))
        self.say(
            f"==> {p.label} died (exit code {code}); restarting in {verdict.delay_s:g}s (restart {verdict.attempt})"
        )
        self._restarting[i] = asyncio.create_task(self._restart(i, p, verdict.delay_s), name=f"restart:{p.label}")

    async def _restart(self, i: int, dead: Proc, delay_s: float) -> None:
        if self.buried is not None:
            await self.buried(dead)
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
