"""Runtime settings: the cluster spec plus the few documented environment overrides.

Read once at the edge (a service's ``__main__`` or the CLI) and passed inward. Tests build
`Settings` directly. The environment variables, all optional:

=====================  ==========================================================================
``BUBBLETEA_CONFIG``   path of the cluster spec (default: ``configs/demo.yaml`` of this checkout)
``REDIS_URL``          the bus; unset means "start an embedded redis-server" (launcher and demo)
``BUBBLETEA_HTTP_HOST`` / ``BUBBLETEA_HTTP_PORT``  override ``http.host`` / ``http.port``
``BUBBLETEA_LOG_LEVEL`` DEBUG, INFO (default), WARNING or ERROR
``BUBBLETEA_LOG_FORMAT`` ``kv`` (default: key=value lines) or ``json`` (one JSON object per line)
``BUBBLETEA_RUN``      the training run id that scopes streams and leases (default ``run``)
``BUBBLETEA_API_KEY``  if set, the prefill API requires ``Authorization: Bearer <key>``
``BUBBLETEA_DECODE``   ``on`` or ``off``: override ``decode.enabled``; ``vllm``: on, decoded by the
                       vLLM server at ``decode.vllm_url`` (``decode.engine: vllm``, docs/vllm.md)
``BUBBLETEA_VLLM_URL`` override ``decode.vllm_url``
``BUBBLETEA_TTFT_OBJECTIVE_MS`` override ``prefill.ttft_objective_ms`` (milliseconds; ``none``: no objective)
``BUBBLETEA_ITERATIONS`` override ``training.iterations``: a number, or ``until_stopped``
``BUBBLETEA_DECAY_ITERS`` override ``training.decay_iters`` (where the cosine learning rate ends):
                       a number (a run trained past its iterations keeps the spec's schedule)
``BUBBLETEA_METRICS_HOST`` / ``BUBBLETEA_METRICS_PORT``  where a bus service (dispatcher, worker,
                       broker) serves Prometheus ``/metrics``: default 127.0.0.1 and port 0 (any
                       free port, advertised in its heartbeat); ``off`` turns the endpoint off
``BUBBLETEA_METRICS_AUTH`` ``on``: every service's ``/metrics`` needs the API key too (default ``off``)
``BUBBLETEA_WAN``       ``model``, ``kernel`` or ``none``: override ``wan.mode``
``BUBBLETEA_PLANE_HOST`` the address this host's stage workers (and decoders) bind for the data
                       plane (default 127.0.0.1; with ``wan.mode: none`` an address the other
                       hosts can reach; ``auto``: the address this host's name resolves to, e.g.
                       a container's own on a Docker network)
``BUBBLETEA_COMPUTE_PRIORITY`` ``low`` (default): a stage worker runs its torch threads below the
                       event loops (training at nice 5, prefill at nice 15: `shared.runtime.priority`);
                       ``normal``: every thread at nice 0
``BUBBLETEA_TIME_SCALE`` the device time scale k >= 1: one profiled millisecond lasts k real ones
                       (device profile, WAN, work sent ahead: `shared.config.timescale`); the launchers
                       measure and set it (default 1)
``BUBBLETEA_RESUME``    a stage worker restores its stage from this save directory (``bubbletea train --resume``)
``BUBBLETEA_STATE_DIR`` where stage workers keep a run's saved state, in ``<dir>/<run>/``: its
                       checkpoints (``training.checkpoint_every``) and the state handed over for
                       ``bubbletea train --save`` (Redis holds only their paths). Default
                       ``<temp dir>/bubbletea-state``; ``bubbletea up`` gives ``<run folder>/state``. A
                       replacement worker reads its slot's checkpoint from here: workers on several
                       hosts need one directory every host shares (docs/deploy.md)
``BUBBLETEA_DC``        a stage worker takes only slots whose stage is placed in this datacenter
                       (the workers of one DC on one host; default: any slot)
``BUBBLETEA_LEASE_LIVENESS`` ``on`` (default): a dead worker's slot frees once its connections closed,
                       before its lease expires (`shared.policies.lease_liveness`); ``off``: at expiry
``BUBBLETEA_REDIS_MAXMEMORY`` the embedded redis-server's ``maxmemory`` (default ``1gb``; policy
                       ``noeviction``)
``BUBBLETEA_REDIS_WAIT_S`` how long a service started with Redis unreachable retries (with backoff)
                       before it exits with one line (seconds, default 60)
=====================  ==========================================================================
"""

from __future__ import annotations

import math
import os
import re
import socket
import tempfile
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

import msgspec

from shared.config.spec import ClusterSpec, ConfigError, check_decode, load_spec
from shared.config.timescale import LIMIT_SCALE, scale_spec
from shared.config.training import MAX_ITERATIONS, UNTIL_STOPPED, Training
from shared.runtime.logs import get_logger
from shared.runtime.priority import PRIORITIES
from shared.runtime.redis_server import maxmemory_error

log = get_logger(__name__)

DEFAULT_SPEC = Path(__file__).resolve().parents[2] / "configs" / "demo.yaml"
#: How long a service started while Redis is unreachable keeps trying (BUBBLETEA_REDIS_WAIT_S).
DEFAULT_REDIS_WAIT_S = 60.0
#: Where stage workers keep a run's checkpoints and saves when BUBBLETEA_STATE_DIR is not set.
DEFAULT_STATE_DIR = Path(tempfile.gettempdir()) / "bubbletea-state"

#: Every environment variable BubbleTea reads (here, and BUBBLETEA_REDIS_SERVER in redis_server).
ENV_VARS = frozenset(
    {
        "REDIS_URL",
        "BUBBLETEA_CONFIG",
        "BUBBLETEA_HTTP_HOST",
        "BUBBLETEA_HTTP_PORT",
        "BUBBLETEA_LOG_LEVEL",
        "BUBBLETEA_LOG_FORMAT",
        "BUBBLETEA_RUN",
        "BUBBLETEA_API_KEY",
        "BUBBLETEA_REDIS_SERVER",
        "BUBBLETEA_ITERATIONS",
        "BUBBLETEA_DECAY_ITERS",
        "BUBBLETEA_VLLM_URL",
        "BUBBLETEA_TTFT_OBJECTIVE_MS",
        "BUBBLETEA_DECODE",
        "BUBBLETEA_METRICS_HOST",
        "BUBBLETEA_METRICS_PORT",
        "BUBBLETEA_METRICS_AUTH",
        "BUBBLETEA_REDIS_MAXMEMORY",
        "BUBBLETEA_WAN",
        "BUBBLETEA_PLANE_HOST",
        "BUBBLETEA_DC",
        "BUBBLETEA_LEASE_LIVENESS",
        "BUBBLETEA_RESUME",
        "BUBBLETEA_STATE_DIR",
        "BUBBLETEA_COMPUTE_PRIORITY",
        "BUBBLETEA_TIME_SCALE",
        "BUBBLETEA_MAX_TIME_SCALE",
        "BUBBLETEA_REDIS_WAIT_S",
        "BUBBLETEA_CHAOS_PREFILL",
    }
)
#: BUBBLETEA_* variables read elsewhere: by the launcher and the CLI (persist, progress bar), compose
#: (its file's ${...}), the benchmarks and the test harnesses. Known, so never warned about.
OTHER_ENV_VARS = frozenset(
    {
        "BUBBLETEA_REDIS_PERSIST",
        "BUBBLETEA_PROGRESS",
        "BUBBLETEA_SPEC",
        "BUBBLETEA_MODEL_DIR",
        "BUBBLETEA_PORT",
        "BUBBLETEA_VLLM_PYTHON",
        "BUBBLETEA_COMPOSE_TESTS",
        "BUBBLETEA_SLURM_TESTS",
    }
)
#: Unknown variables already warned about in this process (one warning each).
_warned: set[str] = set()
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")
LOG_FORMATS = ("kv", "json")
WAN_MODES = ("model", "kernel", "none")


@dataclass(frozen=True)
class Settings:
    spec: ClusterSpec
    spec_path: Path
    #: None means no external Redis was named: the launcher starts an embedded one. It may hold a
    #: password: log `mask_url(redis_url)`, never the URL itself (kept out of the repr).
    redis_url: str | None = field(default=None, repr=False)
    log_level: str = "INFO"
    log_format: str = "kv"
    run: str = "run"
    api_key: str | None = field(default=None, repr=False)
    #: Every service's /metrics asks for the API key too (BUBBLETEA_METRICS_AUTH=on).
    metrics_auth: bool = False
    #: Where a bus service serves Prometheus /metrics; port 0 = any free port, None = no endpoint.
    metrics_host: str = "127.0.0.1"
    metrics_port: int | None = 0
    #: The address this host's stage workers bind for the data plane (BUBBLETEA_PLANE_HOST).
    plane_host: str = "127.0.0.1"
    #: Torch threads below the event loops (BUBBLETEA_COMPUTE_PRIORITY=low) or not (normal).
    compute_priority: str = "low"
    #: One profiled ms lasts this many real ms (BUBBLETEA_TIME_SCALE; `spec` is already scaled).
    time_scale: float = 1.0
    #: A launcher refuses a measured time scale above this (BUBBLETEA_MAX_TIME_SCALE); None = no cap.
    max_time_scale: float | None = None
    #: `spec` before the time scale: what a launcher writes for the services it starts (they
    #: apply the scale themselves, from the environment they inherit).
    base_spec: ClusterSpec | None = None
    #: A stage worker takes only slots of this datacenter's stages (BUBBLETEA_DC); None = any.
    dc: str | None = None
    #: A save directory the stage workers continue training from (BUBBLETEA_RESUME).
    resume: Path | None = None
    #: Where stage workers keep a run's checkpoints and handed-over state, under `<state_dir>/<run>/`
    #: (BUBBLETEA_STATE_DIR); shared by every host whose workers may replace each other.
    state_dir: Path = field(default_factory=lambda: DEFAULT_STATE_DIR)
    #: How long a service waits at start for Redis to answer before it exits (BUBBLETEA_REDIS_WAIT_S).
    redis_wait_s: float = DEFAULT_REDIS_WAIT_S
    #: A dead worker's slot frees once its connections closed, before its lease expires (BUBBLETEA_LEASE_LIVENESS).
    lease_liveness: bool = True
    #: Fault injection: make the stage workers' prefill fail (BUBBLETEA_CHAOS_PREFILL,
    #: services/stage_worker/chaos.py); None in normal runs.
    chaos_prefill: str | None = None

    @property
    def metrics_key(self) -> str | None:
        """The key a scrape of /metrics must carry, or None when /metrics is open."""
        return self.api_key if self.metrics_auth else None

    def with_spec(self, change: Callable[[ClusterSpec], ClusterSpec]) -> Settings:
        """These settings with `change` made to the spec in effect and to the unscaled one the
        services are given (they apply the time scale themselves)."""
        base = change(self.base_spec or self.spec)
        return replace(self, spec=change(self.spec), base_spec=base)

    def require_redis_url(self) -> str:
        """The bus URL for a service process; services never start a private Redis of their own."""
        if not self.redis_url:
            raise ConfigError(
                "REDIS_URL is not set: start services with `bubbletea demo` (which starts an "
                "embedded Redis) or point REDIS_URL at a Redis 6.2+ server, e.g. "
                "redis://127.0.0.1:6379/0"
            )
        return self.redis_url


def unknown_env(env: Mapping[str, str]) -> list[str]:
    """One line per BUBBLETEA_* variable in `env` that nothing reads (a typo, say), naming the
    nearest known one."""
    import difflib

    known = ENV_VARS | OTHER_ENV_VARS
    lines = []
    for name in sorted(k for k in env if k.startswith("BUBBLETEA_") and k not in known):
        near = difflib.get_close_matches(name, sorted(known), n=1)
        hint = f": did you mean {near[0]}?" if near else " (docs/config.md lists the ones read)"
        lines.append(f"{name} is not a variable BubbleTea reads; it is ignored{hint}")
    return lines


def load_settings(config: str | Path | None = None, env: Mapping[str, str] | None = None) -> Settings:
    """Load the spec named by `config` (or ``BUBBLETEA_CONFIG``) and apply environment overrides.
    An unknown BUBBLETEA_* variable is warned about once per process (`unknown_env`)."""
    env = os.environ if env is None else env
    for line in unknown_env(env):
        if line not in _warned:
            _warned.add(line)
            log.warning(line)
    path = Path(config or env.get("BUBBLETEA_CONFIG") or DEFAULT_SPEC)
    spec = load_spec(path)
    http = spec.http
    if host := env.get("BUBBLETEA_HTTP_HOST"):
        http = msgspec.structs.replace(http, host=host)
    if port := env.get("BUBBLETEA_HTTP_PORT"):
        if not port.isdigit() or not 0 <= int(port) <= 65_535:
            raise ConfigError(f"BUBBLETEA_HTTP_PORT: expected a port number 0-65535, got {port!r}")
        http = msgspec.structs.replace(http, port=int(port))
    spec = msgspec.structs.replace(spec, http=http)
    if decode := env.get("BUBBLETEA_DECODE"):
        if decode not in ("on", "off", "vllm"):
            raise ConfigError(f"BUBBLETEA_DECODE: expected on, off or vllm, got {decode!r}")
        engine = "vllm" if decode == "vllm" else spec.decode.engine
        d = msgspec.structs.replace(spec.decode, enabled=decode != "off", engine=engine)
        spec = msgspec.structs.replace(spec, decode=d)
    if (objective := env.get("BUBBLETEA_TTFT_OBJECTIVE_MS")) is not None and objective.strip():
        spec = msgspec.structs.replace(spec, prefill=msgspec.structs.replace(
            spec.prefill, ttft_objective_ms=objective_ms(objective, "BUBBLETEA_TTFT_OBJECTIVE_MS")))  # fmt: skip
    if vllm_url := env.get("BUBBLETEA_VLLM_URL"):
        spec = msgspec.structs.replace(spec, decode=msgspec.structs.replace(spec.decode, vllm_url=vllm_url))
    if "BUBBLETEA_DECODE" in env or "BUBBLETEA_VLLM_URL" in env:
        check_decode(spec)
    if wan := env.get("BUBBLETEA_WAN"):
        if wan not in WAN_MODES:
            raise ConfigError(f"BUBBLETEA_WAN: expected one of {', '.join(WAN_MODES)}, got {wan!r}")
        spec = msgspec.structs.replace(spec, wan=msgspec.structs.replace(spec.wan, mode=wan))
    dc = env.get("BUBBLETEA_DC") or None
    if dc is not None and dc not in {d.name for d in spec.datacenters}:
        names = ", ".join(d.name for d in spec.datacenters)
        raise ConfigError(f"BUBBLETEA_DC: {dc!r} is not a datacenter of the spec (it has {names})")
    time_scale = _time_scale(env.get("BUBBLETEA_TIME_SCALE", "1"))
    cap = env.get("BUBBLETEA_MAX_TIME_SCALE")
    max_time_scale = _time_scale(cap, "BUBBLETEA_MAX_TIME_SCALE") if cap else None
    if iterations := env.get("BUBBLETEA_ITERATIONS"):
        spec = msgspec.structs.replace(spec, training=_iterations(spec, iterations))
    if decay := env.get("BUBBLETEA_DECAY_ITERS"):
        decay_iters = _count("BUBBLETEA_DECAY_ITERS", decay)
        spec = msgspec.structs.replace(spec, training=msgspec.structs.replace(spec.training, decay_iters=decay_iters))
    level = env.get("BUBBLETEA_LOG_LEVEL", "INFO").upper()
    if level not in LOG_LEVELS:
        raise ConfigError(f"BUBBLETEA_LOG_LEVEL: expected one of {', '.join(LOG_LEVELS)}, got {level!r}")
    log_format = env.get("BUBBLETEA_LOG_FORMAT", "kv").lower()
    if log_format not in LOG_FORMATS:
        raise ConfigError(f"BUBBLETEA_LOG_FORMAT: expected one of {', '.join(LOG_FORMATS)}, got {log_format!r}")
    url = env.get("REDIS_URL") or None
    if url and not url.startswith(("redis://", "rediss://", "unix://")):
        raise ConfigError(f"REDIS_URL: expected redis://host:port/db, rediss:// or unix://, got {url!r}")
    run = env.get("BUBBLETEA_RUN", "run")
    if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}", run):
        raise ConfigError(f"BUBBLETEA_RUN: letters, digits, '.', '_' and '-' only (1-64 chars), got {run!r}")
    api_key = env.get("BUBBLETEA_API_KEY") or None
    metrics_auth = env.get("BUBBLETEA_METRICS_AUTH", "off").lower()
    if metrics_auth not in ("on", "off"):
        raise ConfigError(f"BUBBLETEA_METRICS_AUTH: expected on or off, got {metrics_auth!r}")
    if metrics_auth == "on" and not api_key:
        raise ConfigError("BUBBLETEA_METRICS_AUTH=on puts /metrics behind the API key: set BUBBLETEA_API_KEY too")
    metrics_port = _metrics_port(env.get("BUBBLETEA_METRICS_PORT", "0"))
    if (maxmemory := env.get("BUBBLETEA_REDIS_MAXMEMORY")) and (error := maxmemory_error(maxmemory)):
        raise ConfigError(error)
    redis_wait_s = _seconds("BUBBLETEA_REDIS_WAIT_S", env.get("BUBBLETEA_REDIS_WAIT_S", str(DEFAULT_REDIS_WAIT_S)))
    chaos_prefill = env.get("BUBBLETEA_CHAOS_PREFILL") or None
    if chaos_prefill is not None and not re.fullmatch(r"(raise|oom)(-after:\d+)?", chaos_prefill):
        raise ConfigError(
            f"BUBBLETEA_CHAOS_PREFILL: expected raise, oom, raise-after:N or oom-after:N (N blocks run first), "
            f"got {chaos_prefill!r}"
        )
    liveness = env.get("BUBBLETEA_LEASE_LIVENESS", "on").lower()
    if liveness not in ("on", "off"):
        raise ConfigError(f"BUBBLETEA_LEASE_LIVENESS: expected on or off, got {liveness!r}")
    priority = env.get("BUBBLETEA_COMPUTE_PRIORITY", "low").lower()
    if priority not in PRIORITIES:
        raise ConfigError(f"BUBBLETEA_COMPUTE_PRIORITY: expected low or normal, got {priority!r}")
    return Settings(
        spec=scale_spec(spec, time_scale),
        base_spec=spec,
        spec_path=path,
        redis_url=url,
        log_level=level,
        log_format=log_format,
        run=run,
        api_key=api_key,
        metrics_host=env.get("BUBBLETEA_METRICS_HOST") or "127.0.0.1",
        metrics_port=metrics_port,
        metrics_auth=metrics_auth == "on",
        plane_host=_plane_host(env.get("BUBBLETEA_PLANE_HOST") or "127.0.0.1"),
        compute_priority=priority,
        time_scale=time_scale,
        max_time_scale=max_time_scale,
        dc=dc,
        resume=Path(env["BUBBLETEA_RESUME"]) if env.get("BUBBLETEA_RESUME") else None,
        state_dir=Path(env["BUBBLETEA_STATE_DIR"]).absolute() if env.get("BUBBLETEA_STATE_DIR") else DEFAULT_STATE_DIR,
        redis_wait_s=redis_wait_s,
        chaos_prefill=chaos_prefill,
        lease_liveness=liveness == "on",
    )


def _seconds(var: str, value: str) -> float:
    try:
        s = float(value)
    except ValueError:
        s = math.nan
    if not 0 < s <= 86_400:
        raise ConfigError(f"{var}: expected a number of seconds above 0 and at most 86400, got {value!r}")
    return s


def _time_scale(value: str, var: str = "BUBBLETEA_TIME_SCALE") -> float:
    try:
        k = float(value)
    except ValueError:
        k = math.nan
    if not (1 <= k <= LIMIT_SCALE):
        raise ConfigError(f"{var}: expected a number from 1 to {LIMIT_SCALE:g}, got {value!r}")
    return k


def _plane_host(value: str) -> str:
    if value != "auto":
        return value
    name = socket.gethostname()
    try:
        return socket.gethostbyname(name)
    except OSError as exc:
        raise ConfigError(
            f"BUBBLETEA_PLANE_HOST is 'auto', but this host's name {name!r} does not resolve: {exc}"
        ) from None


def mask_url(url: str) -> str:
    """`url` with its password (and a username-only secret) replaced by ``***``, for logs and
    printed lines: ``redis://:s3cret@redis:6379/0`` -> ``redis://:***@redis:6379/0``."""
    parts = urlsplit(url)
    if "@" not in parts.netloc:
        return url
    creds, _, host = parts.netloc.rpartition("@")
    user, colon, _ = creds.partition(":")
    masked = f"{user}:***" if colon else "***"
    return urlunsplit(parts._replace(netloc=f"{masked}@{host}"))


def _iterations(spec: ClusterSpec, value: str) -> Training:
    if value == UNTIL_STOPPED:
        return msgspec.structs.replace(spec.training, iterations=UNTIL_STOPPED)
    iterations = _count("BUBBLETEA_ITERATIONS", value, f" or {UNTIL_STOPPED!r}")
    return msgspec.structs.replace(spec.training, iterations=iterations)


def _count(var: str, value: str, alternative: str = "") -> int:
    """`value` as a number of iterations, within what a spec may name (the environment bypasses the
    spec's own validation), or a ConfigError naming `var`."""
    if not value.isdigit() or not 1 <= int(value) <= MAX_ITERATIONS:
        raise ConfigError(f"{var}: expected a number from 1 to {MAX_ITERATIONS:,}{alternative}, got {value!r}")
    return int(value)


def _metrics_port(value: str) -> int | None:
    if value.lower() == "off":
        return None
    if not value.isdigit() or not 0 <= int(value) <= 65_535:
        raise ConfigError(f"BUBBLETEA_METRICS_PORT: expected a port number 0-65535 or 'off', got {value!r}")
    return int(value)


def objective_ms(value: str, what: str) -> float | None:
    """A TTFT objective given in milliseconds (``none`` or 0: no objective), or a ConfigError naming `what`."""
    if value.strip().lower() in ("none", "0", "off"):
        return None
    try:
        ms = float(value)
    except ValueError:
        raise ConfigError(f"{what}: expected milliseconds (or none), got {value!r}") from None
    if not 0 < ms <= 86_400_000:
        raise ConfigError(f"{what}: expected milliseconds from 1 to 86,400,000 (or none), got {value!r}")
    return ms
