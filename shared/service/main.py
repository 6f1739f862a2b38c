"""The common `__main__` of every service: read settings, set up logging, run under uvloop, stop cleanly.

A service provides ``async def serve(settings, stop: asyncio.Event) -> None`` that returns once
`stop` is set and everything it started is closed. SIGINT and SIGTERM set `stop`; a second
SIGINT while stopping (a person's second Ctrl-C) exits at once. A second SIGTERM is the same request
again, not impatience: a launcher killed with SIGKILL sends its death signal (`die_with_parent`)
once for each thread it had, and a dispatcher taking the second for "exit now" left its loop from
inside a signal handler (2026-12-01). Whoever must stop a service at once sends SIGKILL.
Tests call ``serve`` (or the app factory) directly.
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import sys
import time
from collections.abc import Awaitable, Callable, Sequence
from datetime import UTC, datetime, timedelta

import uvloop
from aiohttp import web
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from shared.config.model_info import CheckpointError
from shared.config.settings import Settings, load_settings, mask_url
from shared.config.spec import ConfigError
from shared.policies.restarts import EXIT_CONFIG  # a bad spec, an unloadable checkpoint, a missing device
from shared.runtime.logs import get_logger, setup_logging

log = get_logger(__name__)

Serve = Callable[[Settings, asyncio.Event], Awaitable[None]]


class Stop(asyncio.Event):
    """The `stop` a service is given, saying which signal set it (None: not a signal). A stage
    worker reads it: SIGTERM from an orchestrator asks it to leave the run, not stop it."""

    def __init__(self) -> None:
        super().__init__()
        self.signal: signal.Signals | None = None


def stopped_by(stop: asyncio.Event) -> signal.Signals | None:
    """The signal that set `stop` (None: not a signal, or a plain event: a test's)."""
    return stop.signal if isinstance(stop, Stop) else None


def exits_at_once(sig: signal.Signals) -> bool:
    """Whether `sig`, come while the service is already stopping, ends it at once: a second Ctrl-C
    does; a second SIGTERM is the same request again (the module's docstring says why)."""
    return sig == signal.SIGINT


class ListenError(OSError):
    """An HTTP service could not bind its address (the port taken, say): said in one line."""


def run_service(
    name: str,
    serve: Serve,
    argv: Sequence[str] | None = None,
    *,
    description: str = "",
    check: Callable[[Settings], object] | None = None,
) -> int:
    ap = argparse.ArgumentParser(
        prog=f"python -m services.{name}",
        description=description,
        epilog="Environment: REDIS_URL (required), BUBBLETEA_CONFIG, BUBBLETEA_LOG_LEVEL, "
        "BUBBLETEA_HTTP_HOST, BUBBLETEA_HTTP_PORT. See docs/config.md.",
    )
    ap.add_argument("--config", help="cluster spec file (default: $BUBBLETEA_CONFIG or configs/demo.yaml)")
    args = ap.parse_args(argv)
    try:
        settings = load_settings(args.config)
        settings.require_redis_url()
    except ConfigError as exc:
        print(f"{name}: configuration error: {exc}", file=sys.stderr)
        return EXIT_CONFIG
    setup_logging(name, settings.log_level, settings.log_format)
    code = uvloop.run(_main(name, serve, settings, check))
    # Stopped: a late SIGTERM (a launcher stopping everything) must not turn a clean exit into a
    # death by signal while the interpreter tears down.
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    return code


async def _main(name: str, serve: Serve, settings: Settings, check: Callable[[Settings], object] | None) -> int:
    stop = Stop()
    loop = asyncio.get_running_loop()

    def on_signal(sig: signal.Signals) -> None:
        if stop.is_set():
            if not exits_at_once(sig):
                log.info("stopping already", signal=sig.name)
                return
            log.warning("second Ctrl-C while stopping; exiting now", signal=sig.name)
            raise SystemExit(130)
        log.info("stopping", signal=sig.name)
        stop.signal = sig
        stop.set()

    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, on_signal, sig)
    log.info("starting", service=name, spec=str(settings.spec_path))
    try:
        if check is not None:  # what needs no Redis: a spec this process cannot run is refused at once
            check(settings)
        if not await wait_for_redis(settings.require_redis_url(), settings.redis_wait_s, stop):
            return 0 if stop.is_set() else EXIT_UNREACHABLE
        await serve(settings, stop)
    except (ConfigError, CheckpointError) as exc:  # the same every time: a restart cannot help
        log.error("cannot run with this configuration", service=name, error=str(exc))
        return EXIT_CONFIG
    except ListenError as exc:  # may pass (a port freed later): a launcher may try again
        log.error("cannot listen", service=name, error=str(exc))
        return 1
    except (RedisConnectionError, RedisTimeoutError) as exc:  # an outage longer than its calls ride out
        log.error("redis unreachable; giving up", service=name, error=str(exc))
        return EXIT_UNREACHABLE
    except Exception as exc:
        log.exception("service failed", service=name, error=repr(exc))
        return 1
    log.info("stopped", service=name)
    return 0


#: A service that cannot reach Redis (at start, within BUBBLETEA_REDIS_WAIT_S; or later, longer
#: than its calls ride an outage out) exits with this code (a launcher restarts it).
EXIT_UNREACHABLE = 1


async def wait_for_redis(url: str, wait_s: float, stop: asyncio.Event) -> bool:
    """PING Redis until it answers (True), backing off as the bus does, until `wait_s` have passed
    or `stop` is set (False). The deadline is stated in the first warning; the end in one line."""
    from shared.bus.connection import CONNECT_TIMEOUT_S, backoff, client_for, no_retry

    r = client_for(
        url,
        socket_timeout=None,  # as the bus's clients (shared/bus/connection.py)
        socket_connect_timeout=CONNECT_TIMEOUT_S,
        retry=no_retry(),
    )
    deadline = time.monotonic() + wait_s
    until = (datetime.now(UTC) + timedelta(seconds=wait_s)).isoformat(timespec="seconds").replace("+00:00", "Z")
    failures = 0
    try:
        while True:
            try:
                await r.ping()
            except (RedisConnectionError, RedisTimeoutError, OSError) as exc:
                if not failures:
                    log.warning(
                        "redis unreachable; retrying with backoff until the deadline, then exiting",
                        url=mask_url(url),
                        deadline=until,
                        wait_s=wait_s,
                        error=str(exc),
                    )
                failures += 1
                delay = backoff().compute(failures)
                if time.monotonic() + delay > deadline:
                    log.error(
                        "redis still unreachable at the deadline; exiting (start Redis, or check REDIS_URL)",
                        url=mask_url(url),
                        waited_s=wait_s,
                        error=str(exc),
                    )
                    return False
                try:
                    await asyncio.wait_for(stop.wait(), delay)
                    return False
                except TimeoutError:
                    continue
            if failures:
                log.info("redis reachable", url=mask_url(url), failures=failures)
            return True
    finally:
        await r.aclose()


async def serve_app(
    app: web.Application,
    host: str,
    port: int,
    stop: asyncio.Event,
    *,
    on_listening: Callable[[str], None] | None = None,
    shutdown_timeout: float = 10.0,
    runner_class: Callable[..., web.AppRunner] = web.AppRunner,
) -> None:
    """Run an aiohttp app until `stop` is set; cleanup contexts run in reverse order on the way out.
    `runner_class` builds the runner (a service's own, for its HTTP server's limits and timeouts)."""
    runner = runner_class(app, access_log=None, shutdown_timeout=shutdown_timeout, handle_signals=False)
    await runner.setup()
    try:
        site = web.TCPSite(runner, host, port)
        try:
            await site.start()
        except OSError as exc:  # a port taken or not ours to bind: one line, not a traceback
            raise ListenError(
                f"cannot listen on {host}:{port}: {exc.strerror or exc}; set BUBBLETEA_HTTP_PORT (or http.port) to "
                "a free port, or stop what holds this one"
            ) from None
        addr = runner.addresses[0]
        url = f"http://{addr[0]}:{addr[1]}"
        log.info("listening", url=url)
        if on_listening:
            on_listening(url)
        await stop.wait()
    finally:
        await runner.cleanup()
