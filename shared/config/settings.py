"""Runtime settings: the cluster spec plus the few documented environment overrides.

Read once at the edge (a service's ``__main__`` or the CLI) and passed inward. Tests build
`Settings` directly. The environment variables, all optional, are the table `shared.config.env.ENV`
(their parsing, what each changes, and the documentation docs/config.md shows).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

from shared.config.env import read_env, unknown_env
from shared.config.env_values import DEFAULT_REDIS_WAIT_S, DEFAULT_STATE_DIR
from shared.config.spec import ClusterSpec, ConfigError, check_decode, load_spec
from shared.config.timescale import scale_spec

log = logging.getLogger(__name__)  # the standard logger: the config package sits below `shared.runtime`

DEFAULT_SPEC = Path(__file__).resolve().parents[2] / "configs" / "demo.yaml"
#: Unknown variables already warned about in this process (one warning each).
_warned: set[str] = set()


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


def load_settings(config: str | Path | None = None, env: Mapping[str, str] | None = None) -> Settings:
    """Load the spec named by `config` (or ``BUBBLETEA_CONFIG``) and apply environment overrides.
    An unknown BUBBLETEA_* variable is warned about once per process (`unknown_env`)."""
    env = os.environ if env is None else env
    for line in unknown_env(env):
        if line not in _warned:
            _warned.add(line)
            log.warning(line)
    path = Path(config or env.get("BUBBLETEA_CONFIG") or DEFAULT_SPEC)
    draft = read_env(load_spec(path), env)
    if "BUBBLETEA_DECODE" in env or "BUBBLETEA_VLLM_URL" in env:
        check_decode(draft.spec)
    time_scale = draft.settings.get("time_scale", 1.0)
    return Settings(spec=scale_spec(draft.spec, time_scale), base_spec=draft.spec, spec_path=path, **draft.settings)


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
