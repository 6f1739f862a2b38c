"""Services started by fork from a server that has already imported them (and torch).

A stage worker spends about 3 CPU seconds before it does anything: importing torch, our modules,
and `torch._dynamo`, which torch's optimizers import at their first step. A launcher that starts
twelve workers on two cores pays that twelve times. Here it is paid once: the standard library's
fork server (`multiprocessing`'s "forkserver" start method) imports the modules in `PRELOAD` when
the launcher first needs it, and every worker is a fork of it, with the imports done and their
pages shared.

A forked service is what `python -m MODULE` would be, as `procs.spawn` starts it: its own session
(process group), its niceness, the launcher's environment plus its own, stdout and stderr to a pipe
the launcher reads, `argv` as the module sees it, and SIGTERM when the process that started it
dies (the fork server, which itself leaves when the launcher does, even killed with SIGKILL:
`_let_the_server_go`; and multiprocessing stops a fork still running when the launcher exits). The
server forks before any thread or CUDA context exists: only imports have run in it. As in every
multiprocessing child, the launcher's main module is imported again in the fork (`__mp_main__`;
`bubbletea`'s is three lines).

`multiprocessing` brings the server, the passing of the pipe's descriptor and the exit status; a
hand-written one would be the same hundred lines less tried. Where the platform has no fork
server, services are started as processes (`procs.spawn`'s other path).
"""

from __future__ import annotations

import asyncio
import contextlib
import multiprocessing
import os
import runpy
import signal
import sys
import threading
import time
from multiprocessing.context import ForkServerContext, ForkServerProcess
from typing import Any

import setproctitle

from shared.runtime.lifetime import die_with_parent

#: What the fork server imports before its first fork: what the worker's `__main__` imports (not
#: `__main__` itself: runpy warns when a package's `__main__` is imported before it runs it), and
#: what its first optimizer step imports (AdamW's `_use_grad_for_differentiable` imports
#: torch._dynamo, about 0.6 s).
PRELOAD = ("services.stage_worker.worker", "shared.service.main", "torch._dynamo")

_context: ForkServerContext | None = None


def available() -> bool:
    """Whether a service can be forked here: the platform has the fork server (Linux and macOS do;
    Windows does not), and the launcher's main module can be imported again in a fork, as
    multiprocessing does (a script on the standard input cannot)."""
    if "forkserver" not in multiprocessing.get_all_start_methods():
        return False
    main = sys.modules["__main__"]
    path = getattr(main, "__file__", None)
    return getattr(main, "__spec__", None) is not None or path is None or os.path.isfile(path)


def context() -> ForkServerContext:
    """The fork-server context, its preload set once per launcher process."""
    global _context
    if _context is None:
        ctx = multiprocessing.get_context("forkserver")
        assert isinstance(ctx, ForkServerContext)
        ctx.set_forkserver_preload(list(PRELOAD))
        _context = ctx
    return _context


def shutdown(grace_s: float = 10.0) -> None:
    """Stop what the fork server started and is still running, then the fork server and
    multiprocessing's resource tracker, and wait for both: a command that returns leaves none of its
    processes behind (they would otherwise linger in its process group for a second or more, until
    they notice it is gone). `_stop` is multiprocessing's own way, what CPython's tests use; it is
    private, so it is looked up and any failure ignored.

    Live forks get SIGTERM first (SIGKILL after `grace_s`): a fork the launcher never stopped (a
    Ctrl-C while its start was in flight) is stopped and waited for here, not left to the server's
    exit; the server gets SIGKILL if it has still not exited by then."""
    if _context is None:
        return
    from multiprocessing import forkserver, resource_tracker

    _stop_forks(grace_s)
    server_pid = getattr(forkserver._forkserver, "_forkserver_pid", None)
    watchdog = threading.Timer(grace_s, _kill_quietly, (server_pid,)) if server_pid else None
    if watchdog is not None:
        watchdog.daemon = True
        watchdog.start()
    try:
        for owner in (forkserver._forkserver, resource_tracker._resource_tracker):
            stop = getattr(owner, "_stop", None)
            if stop is not None:
                with contextlib.suppress(Exception):
                    stop()
    finally:
        if watchdog is not None:
            watchdog.cancel()


def _stop_forks(grace_s: float) -> None:
    """SIGTERM to every fork still running (a service drains on it), SIGKILL to any left after `grace_s`."""
    forks = multiprocessing.active_children()
    for fork in forks:
        with contextlib.suppress(OSError):
            fork.terminate()
    deadline = time.monotonic() + grace_s
    for fork in forks:
        fork.join(max(0.0, deadline - time.monotonic()))
        if fork.exitcode is None:
            with contextlib.suppress(OSError):
                fork.kill()
            fork.join(5)


def _kill_quietly(pid: int) -> None:
    with contextlib.suppress(OSError):
        os.kill(pid, signal.SIGKILL)


def _let_the_server_go() -> None:
    """In a fork: close its copy of the fork server's "a client lives" pipe. multiprocessing hands
    it to every fork, so that a fork may start forks of its own (ours do not), and the server exits
    only once no copy is left. Kept here, it kept the server alive after the launcher was killed,
    and so this fork, which dies with the server (`die_with_parent`): a `kill -9` of `bubbletea up`
    left its stage workers running for ever (2026-11-29). Private to multiprocessing: looked up,
    and any failure ignored."""
    from multiprocessing import forkserver

    server = forkserver._forkserver
    fd = getattr(server, "_forkserver_alive_fd", None)
    if isinstance(fd, int):
        with contextlib.suppress(OSError):
            os.close(fd)
        server._forkserver_alive_fd = None  # type: ignore[attr-defined]


def _child(module: str, argv: list[str], env: dict[str, str], out: Any, nice: int) -> None:
    """In the forked child: become the service, as `python -m module *argv` would have."""
    os.setsid()
    die_with_parent()
    _let_the_server_go()
    if nice:
        os.nice(nice)
    fd = out.fileno()
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    out.close()
    # What `ps`, `top` and `pgrep -f services.stage_worker` show, rather than the fork server's line.
    # Before the environment is replaced: setproctitle finds the room it writes in at its first call,
    # from where the process's first environment lies.
    setproctitle.setproctitle(" ".join([sys.executable, "-m", module, *argv]))
    os.environ.clear()
    os.environ.update(env)
    sys.argv = [module, *argv]
    runpy.run_module(module, run_name="__main__", alter_sys=True)  # a service's __main__ ends in os._exit
    sys.stdout.flush()
    sys.stderr.flush()


class ForkedProcess:
    """A forked service, with what the launcher uses of `asyncio.subprocess.Process`."""

    def __init__(self, process: ForkServerProcess, stdout: asyncio.StreamReader) -> None:
        self._process = process
        self.stdout = stdout
        assert process.pid is not None
        self.pid: int = process.pid
        self._exited: asyncio.Future[None] | None = None

    @property
    def returncode(self) -> int | None:
        """The exit code (negative: the signal that ended it), or None while it runs."""
        return self._process.exitcode

    async def wait(self) -> int:
        """Until it exits; its exit code. The fork server writes the status to the process's
        sentinel, which the event loop watches once for every waiter."""
        if self.returncode is None:
            if self._exited is None:
                loop = asyncio.get_running_loop()
                exited = self._exited = loop.create_future()
                sentinel = self._process.sentinel

                def readable() -> None:
                    loop.remove_reader(sentinel)
                    if not exited.done():
                        exited.set_result(None)

                loop.add_reader(sentinel, readable)
            await asyncio.shield(self._exited)
        code = self.returncode
        assert code is not None  # the sentinel is readable: the status is there (or 255 if lost)
        return code

    def send_signal(self, sig: int) -> None:
        if self.returncode is None:  # not a pid that may already be someone else's
            os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


async def fork(module: str, argv: list[str], env: dict[str, str], nice: int) -> ForkedProcess:
    """Fork `module` from the server (started, and its imports done, on the first call)."""
    ctx = context()
    read, write = ctx.Pipe(duplex=False)
    process = ctx.Process(target=_child, args=(module, argv, env, write, nice), name=module, daemon=True)
    try:
        try:
            await asyncio.to_thread(process.start)  # the first start waits for the server's imports
        finally:
            write.close()  # the child's copy is the only writer left: its exit ends the output
        reader = asyncio.StreamReader()  # the line limit an exec'd service's output has
        pipe = os.fdopen(os.dup(read.fileno()), "rb", buffering=0)
        await asyncio.get_running_loop().connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), pipe)
    finally:
        read.close()
    return ForkedProcess(process, reader)
