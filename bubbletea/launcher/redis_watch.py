"""`bubbletea up` keeps its embedded Redis alive: a redis-server that dies is started again.

The services ride out a Redis outage (they reconnect with backoff, none exits), so once the server
is back on the same port they carry on. With `--persist` it reloads its append-only file and no
accepted request is lost; without, it comes back empty: the workers notice (the run's messages in
flight are gone), fail, and are restarted, so training starts over, and what was queued is lost
(docs/architecture.md, "The bus"). The restart policy is the one the services get
(`shared.policies.restarts`): a backoff, and a crash loop stops everything.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

from bubbletea.launcher.procs import ServiceFailed
from shared.policies.restarts import DEFAULT_POLICY, Death, GiveUp, RestartPolicy, decide
from shared.runtime.redis_server import EmbeddedRedis

#: How often the server's exit is polled: a death is noticed within this.
POLL_S = 0.2


async def keep_redis_alive(
    embedded: EmbeddedRedis,
    say: Callable[[str], None],
    *,
    policy: RestartPolicy = DEFAULT_POLICY,
    clock: Callable[[], float] = time.monotonic,
) -> None:
    """Until cancelled: restart `embedded` when it dies; raises ServiceFailed on a crash loop."""
    deaths: list[Death] = []
    started = clock()
    while True:
        await asyncio.sleep(POLL_S)  # a child's exit code: there is no event for it here
        proc = embedded.proc
        if proc is None or proc.poll() is None:
            continue
        now = clock()
        deaths.append(Death(started, now))
        verdict = decide(deaths, now, policy)
        if isinstance(verdict, GiveUp):
            code = proc.returncode
            raise ServiceFailed(f"redis-server (pid {proc.pid}) died (exit code {code}) and {verdict.reason}")
        kept = "its append-only file" if embedded.persist else "nothing (no --persist): training starts over"
        say(
            f"==> redis died (exit code {proc.returncode}); restarting in {verdict.delay_s:g}s "
            f"(restart {verdict.attempt}); it keeps {kept}"
        )
        await asyncio.sleep(verdict.delay_s)
        # On the loop's thread on purpose: the child's death signal is tied to the forking thread.
        embedded.restart()
        started = clock()
        assert embedded.proc is not None
        say(f"==> redis restarted (pid {embedded.proc.pid}) on {embedded.url}")
