"""Start service processes, prefix their output with their name, wait for health, stop them in order."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import os
import signal
import sys
import time
from collections import deque
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
from redis.exceptions import RedisError

from bubbletea.launcher import forked
from bubbletea.launcher.services import PREFILL_QUEUE, ServiceDef, command
from shared.bus.connection import sync_client_for
from shared.config.settings import mask_url
from shared.config.spec import ConfigError
from shared.runtime.lifetime import die_with_parent
from shared.runtime.logs import get_logger
from shared.runtime.redis_cluster import EmbeddedCluster
from shared.runtime.redis_server import EmbeddedRedis, free_port
from shared.wire import keys

log = get_logger(__name__)

#: How long a service may take from spawn to a healthy answer (imports torch on a slow box).
START_TIMEOUT_S = 60.0
#: How long a service gets to exit after SIGTERM before SIGKILL.
STOP_TIMEOUT_S = 15.0


class ServiceFailed(RuntimeError):
    """A service process died or never became healthy; the message names it and says why."""


@dataclass
class Proc:
    svc: ServiceDef
    proc: asyncio.subprocess.Process | forked.ForkedProcess
    url: str | None = None
    label: str = ""
    tail: deque[str] = field(default_factory=lambda: deque(maxlen=20))
    pump: asyncio.Task[None] | None = None
    #: When it was spawned (`time.monotonic()`): how long it lived, for the restart policy.
    started: float = field(default_factory=time.monotonic)
    #: The environment it was given (over the launcher's own): its Redis and run, for `stop_all`.
    env: dict[str, str] = field(default_factory=dict)

    @property
    def name(self) -> str:
        return self.svc.name


async def spawn(
    svc: ServiceDef,
    env: dict[str, str],
    *,
    out: object = sys.stdout,
    quiet: bool = False,
    log_file: Path | None = None,
    label: str | None = None,
    prefix: Sequence[str] = (),
) -> Proc:
    """Start `svc` as a process; its output goes to `out`, each line prefixed with its name (or
    `label`; with `quiet`, only warnings and errors), and every line to `log_file` if given and
    to `Proc.tail` regardless. `prefix` runs it through a wrapper that execs it (`ip netns exec
    NS`: a worker of the kernel WAN mode inside its datacenter's namespace). A service that imports
    torch (`ServiceDef.forked`) is forked from a server that has imported it already (`forked`),
    unless it needs a wrapper or the platform has no fork server."""
    proc: asyncio.subprocess.Process | forked.ForkedProcess
    how = "exec"
    full_env = {**os.environ, **env}
    if svc.forked and not prefix and forked.available():
        proc, how = await forked.fork(svc.module, [], full_env, svc.nice), "fork"
    else:
        proc = await asyncio.create_subprocess_exec(
            *prefix,
            sys.executable,
            *command(svc),
            env=full_env,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT,
            start_new_session=True,
            preexec_fn=functools.partial(child_setup, svc.nice),
        )
    p = Proc(svc, proc, label=label or svc.name, env=dict(env))
    p.pump = asyncio.create_task(_pump(p, out, quiet, log_file))
    log.info("service started", service=svc.name, pid=proc.pid, start=how)
    return p


def child_setup(nice: int) -> None:
    """In the child before exec: die with the launcher, and take the service's niceness."""
    die_with_parent()
    if nice:
        os.nice(nice)


def open_redis(
    redis_url: str | None, *, persist_dir: Path | None = None, check: bool = True, cluster: bool = False
) -> tuple[str, EmbeddedRedis | EmbeddedCluster | None, str]:
    """The bus to use: `redis_url` if given, else a freshly started embedded redis-server (the
    caller stops it). With `persist_dir` the embedded server keeps an append-only file there
    (fsync on every write), so a restart of it loses no accepted request. Returns (url, the
    embedded server or None, a line saying which). A `redis_url` that does not answer PING raises
    redis-py's ConnectionError at once (unless not `check`). With `cluster` (`up --redis-cluster`)
    the embedded one is a Redis Cluster (3 masters, 1 replica each: shared/runtime/redis_cluster.py)."""
    if cluster:
        if redis_url:
            raise ConfigError(
                "--redis-cluster starts an embedded cluster, and REDIS_URL is set: unset it, or point REDIS_URL "
                "at your cluster (redis+cluster://host:port) without --redis-cluster"
            )
        if persist_dir is not None:
            raise ConfigError("--persist keeps one embedded Redis's append-only file: not with --redis-cluster")
        nodes = EmbeddedCluster().start()
        pids = ",".join(str(s.proc.pid) for s in nodes.servers if s.proc is not None)
        return nodes.url, nodes, f"Redis: {nodes.url} (embedded cluster, 3 masters + 3 replicas, pids {pids})"
    if redis_url:
        if check:
            _ping(redis_url)  # unreachable: one line now (bubbletea.cli), not each service's after its deadline
        return redis_url, None, f"Redis: {mask_url(redis_url)} (REDIS_URL)"
    if persist_dir is not None:
        persist_dir.mkdir(parents=True, exist_ok=True)
    embedded = EmbeddedRedis(
        persist=persist_dir is not None, data_dir=str(persist_dir) if persist_dir is not None else None
    ).start()
    assert embedded.proc is not None
    kept = f", AOF in {persist_dir}" if persist_dir is not None else ", no persistence"
    return (
        embedded.url,
        embedded,
        f"Redis: {embedded.url} (embedded {embedded.binary}, pid={embedded.proc.pid}{kept})",
    )


def _ping(url: str) -> None:
    """PING the Redis at `url` once (redis-py's ConnectionError if it does not answer)."""
    client = sync_client_for(url, socket_connect_timeout=5, socket_timeout=5)
    try:
        client.ping()
    finally:
        client.close()


_CHATTER = ("level=info", "level=debug")


async def _pump(p: Proc, out: object, quiet: bool, log_file: Path | None) -> None:
    """Copy the child's output line by line, each prefixed with the service name."""
    assert p.proc.stdout is not None
    width = 14
    sink = log_file.open("a", buffering=1) if log_file is not None else None
    try:
        async for raw in p.proc.stdout:
            line = raw.decode(errors="replace").rstrip("\n")
            p.tail.append(line)
            if sink is not None:
                sink.write(line + "\n")
            if quiet and any(c in line for c in _CHATTER):
                continue
            print(f"{p.label:<{width}}| {line}", file=out, flush=True)  # type: ignore[call-overload]
    finally:
        if sink is not None:
            sink.close()


async def wait_http_healthy(p: Proc, url: str, timeout: float = START_TIMEOUT_S) -> None:
    """Poll GET url/health until 200; fail fast (naming the service) if the process exits."""
    deadline = time.monotonic() + timeout
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=2)) as http:
        while True:
            if p.proc.returncode is not None:
                raise ServiceFailed(
                    f"{p.name} exited with code {p.proc.returncode} before it was healthy; "
                    f"last output:\n" + "\n".join(p.tail)
                )
            with contextlib.suppress(aiohttp.ClientError, TimeoutError):
                async with http.get(f"{url}/health") as resp:
                    if resp.status == 200:
                        p.url = url
                        return
            if time.monotonic() > deadline:
                raise ServiceFailed(f"{p.name} did not answer {url}/health with 200 within {timeout:.0f}s")
            # Start-up poll: nothing to wait on before the socket listens. The exit check above
            # runs every round, so a crash is reported at once.
            await asyncio.sleep(0.1)


async def start_front_door(env: dict[str, str], *, out: object = sys.stdout, quiet: bool = True) -> Proc:
    """A prefill_queue on a free port of 127.0.0.1 with `env`, once it answers healthy (its base URL
    in `Proc.url`); stopped again if it never does."""
    port = free_port()
    p = await spawn(PREFILL_QUEUE, {**env, "BUBBLETEA_HTTP_PORT": str(port)}, out=out, quiet=quiet)
    try:
        await wait_http_healthy(p, f"http://127.0.0.1:{port}")
    except BaseException:
        await stop_all([p])
        raise
    return p


@contextlib.asynccontextmanager
async def front_door(env: dict[str, str], *, out: object = sys.stdout, quiet: bool = True) -> AsyncIterator[Proc]:
    """`start_front_door`, stopped on the way out."""
    p = await start_front_door(env, out=out, quiet=quiet)
    try:
        yield p
    finally:
        await stop_all([p])


async def stop_all(procs: list[Proc]) -> dict[str, int | None]:
    """SIGTERM in reverse start order, wait, SIGKILL stragglers; returns exit codes by name. A run
    whose stage workers are among them is marked stopping first: each worker's SIGTERM then stops
    the whole run, as a launcher means it, rather than drain that worker alone."""
    # Not in a thread: a stop is often a cancellation (Ctrl-C), and an await here could be cut short
    # before any signal went out. A local Redis answers in well under a millisecond (2 s at most).
    mark_runs_stopping([p for p in procs if p.svc.per_slot and p.proc.returncode is None])
    codes: dict[str, int | None] = {}
    for p in reversed(procs):
        if p.proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                p.proc.send_signal(signal.SIGTERM)
        try:
            await asyncio.wait_for(p.proc.wait(), STOP_TIMEOUT_S)
        except TimeoutError:
            log.warning("service ignored SIGTERM; killing", service=p.name)
            with contextlib.suppress(ProcessLookupError):
                p.proc.kill()
            await p.proc.wait()
        await _reap_group(p)
        if p.pump is not None:
            await asyncio.gather(p.pump, return_exceptions=True)
        codes[p.label or p.name] = p.proc.returncode
    return codes


def mark_runs_stopping(workers: Sequence[Proc]) -> None:
    """Mark the runs of these stage workers stopping (`keys.run_stop_key`); a Redis that does not
    answer is left alone (the workers then cannot read the mark either, and stop their run)."""
    envs = [{**os.environ, **p.env} for p in workers]
    for url, run in {(env.get("REDIS_URL"), env.get("BUBBLETEA_RUN")) for env in envs}:
        if not url or not run:
            continue
        r = sync_client_for(url, socket_timeout=2, socket_connect_timeout=2)
        try:
            r.set(keys.run_stop_key(run), "stopped by its launcher", ex=keys.LEASE_END_TTL_S)
        except RedisError as exc:
            log.warning("could not mark the run stopping", run=run, error=str(exc))
        finally:
            r.close()


async def _reap_group(p: Proc) -> None:
    """Stop what the service itself started (its process group: `spawn` makes each service a
    session leader), so that nothing a launcher started outlives it: SIGTERM to the group, then
    SIGKILL to whatever is left after `STOP_TIMEOUT_S`, then wait until the group is gone."""
    pgid = p.proc.pid
    try:
        os.killpg(pgid, signal.SIGTERM)
    except (ProcessLookupError, PermissionError):
        return  # the group is empty: the service left nothing behind
    deadline = time.monotonic() + STOP_TIMEOUT_S
    killed = False
    while group_alive(pgid):
        if time.monotonic() > deadline:
            if killed:
                log.warning("processes of a stopped service did not exit", service=p.name, pgid=pgid)
                return
            log.warning("processes of a stopped service ignored SIGTERM; killing", service=p.name, pgid=pgid)
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pgid, signal.SIGKILL)
            killed, deadline = True, time.monotonic() + STOP_TIMEOUT_S
        # not our children (the service's own): no exit to await, only to poll
        await asyncio.sleep(0.05)


def group_alive(pgid: int) -> bool:
    """Whether a process of group `pgid` still runs (a zombie left for its reaper does not)."""
    proc = Path("/proc")
    if not proc.is_dir():  # not Linux: a zombie counts as alive
        try:
            os.killpg(pgid, 0)
        except (ProcessLookupError, PermissionError):
            return False
        return True
    for stat in proc.glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue  # it exited while we looked
        if int(fields[2]) == pgid and fields[0] != "Z":  # state, ppid, pgrp
            return True
    return False
