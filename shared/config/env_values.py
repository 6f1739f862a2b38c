"""What each environment variable may hold and what it changes: the parsers and the changes of
`shared.config.env.ENV` (each raises `ConfigError` naming its variable), and the `Draft` they fill."""

from __future__ import annotations

import math
import re
import socket
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import msgspec

from shared.config.spec import ClusterSpec, ConfigError
from shared.config.timescale import LIMIT_SCALE
from shared.config.training import MAX_ITERATIONS, UNTIL_STOPPED

#: How long a service started while Redis is unreachable keeps trying (BUBBLETEA_REDIS_WAIT_S).
DEFAULT_REDIS_WAIT_S = 60.0
#: Where stage workers keep a run's checkpoints and saves when BUBBLETEA_STATE_DIR is not set.
DEFAULT_STATE_DIR = Path(tempfile.gettempdir()) / "bubbletea-state"
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")
LOG_FORMATS = ("kv", "json")
WAN_MODES = ("model", "kernel", "none")
#: A stage worker's torch threads below its event loops (`low`) or not (`normal`): `shared.runtime.priority`.
PRIORITIES = ("low", "normal")
#: A redis-server memory size: bytes, or a number with a unit (``512mb``, ``2gb``, ``100k``...).
_MEMORY = re.compile(r"\d+(?:[kmg]b?|b)?", re.IGNORECASE)


@dataclass
class Draft:
    """What the variables build, in table order: the spec as overridden so far, and the fields of
    `Settings` read so far (the rest keep their defaults)."""

    spec: ClusterSpec
    settings: dict[str, Any] = field(default_factory=dict)


#: A parsed value that changes nothing (a blank objective).
KEEP = object()


def setting(name: str) -> Callable[[Draft, Any], None]:
    def apply(draft: Draft, value: Any) -> None:
        draft.settings[name] = value

    return apply


def spec_field(section: str, name: str) -> Callable[[Draft, Any], None]:
    def apply(draft: Draft, value: Any) -> None:
        part = msgspec.structs.replace(getattr(draft.spec, section), **{name: value})
        draft.spec = msgspec.structs.replace(draft.spec, **{section: part})

    return apply


def one_of(var: str, allowed: tuple[str, ...], case: Callable[[str], str] = str.lower) -> Callable[[str], str]:
    def parse(value: str) -> str:
        if case(value) not in allowed:
            raise ConfigError(f"{var}: expected one of {', '.join(allowed)}, got {case(value)!r}")
        return case(value)

    return parse


def on_off(var: str) -> Callable[[str], bool]:
    def parse(value: str) -> bool:
        if value.lower() not in ("on", "off"):
            raise ConfigError(f"{var}: expected on or off, got {value.lower()!r}")
        return value.lower() == "on"

    return parse


def port(value: str) -> int:
    if not value.isdigit() or not 0 <= int(value) <= 65_535:
        raise ConfigError(f"BUBBLETEA_HTTP_PORT: expected a port number 0-65535, got {value!r}")
    return int(value)


def redis_url(url: str) -> str:
    """One Redis (``redis://``, ``rediss://``, ``unix://``) or a Redis Cluster
    (``redis+cluster://host:port``, ``rediss+cluster://``: any one node; shared/bus/connection.py)."""
    if url.startswith(("redis+cluster://", "rediss+cluster://")):
        parts = urlsplit(url)
        try:
            port = parts.port
        except ValueError:
            port = None
        if not parts.hostname or not port or parts.path not in ("", "/", "/0"):
            raise ConfigError(
                f"REDIS_URL: a cluster URL is redis+cluster://host:port (one node of the cluster; database 0 only), "
                f"got {url!r}"
            )
        return url
    if not url.startswith(("redis://", "rediss://", "unix://")):
        raise ConfigError(
            f"REDIS_URL: expected redis://host:port/db, rediss://, unix:// or redis+cluster://host:port, got {url!r}"
        )
    return url


def run_id(value: str) -> str:
    if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}", value):
        raise ConfigError(
            "BUBBLETEA_RUN: letters, digits, '.', '_' and '-' only (1-64 chars; a brace would break the hash "
            f"tag of the run's Redis keys, bt:{{<run>}}:...), got {value!r}"
        )
    return value


def metrics_auth(draft: Draft, on: bool) -> None:
    if on and not draft.settings.get("api_key"):
        raise ConfigError("BUBBLETEA_METRICS_AUTH=on puts /metrics behind the API key: set BUBBLETEA_API_KEY too")
    draft.settings["metrics_auth"] = on


def chaos(value: str) -> str:
    if not re.fullmatch(r"(raise|oom)(-after:\d+)?", value):
        raise ConfigError(
            f"BUBBLETEA_CHAOS_PREFILL: expected raise, oom, raise-after:N or oom-after:N (N blocks run first), "
            f"got {value!r}"
        )
    return value


def seconds(var: str) -> Callable[[str], float]:
    def parse(value: str) -> float:
        try:
            s = float(value)
        except ValueError:
            s = math.nan
        if not 0 < s <= 86_400:
            raise ConfigError(f"{var}: expected a number of seconds above 0 and at most 86400, got {value!r}")
        return s

    return parse


def maxmemory_error(value: str) -> str | None:
    """What is wrong with `value` as ``BUBBLETEA_REDIS_MAXMEMORY``, or None if redis-server takes it."""
    if _MEMORY.fullmatch(value):
        return None
    return f"BUBBLETEA_REDIS_MAXMEMORY: expected a redis-server memory size such as 512mb or 2gb, got {value!r}"


def maxmemory(value: str) -> str:
    if error := maxmemory_error(value):
        raise ConfigError(error)
    return value


def time_scale(var: str) -> Callable[[str], float]:
    def parse(value: str) -> float:
        try:
            k = float(value)
        except ValueError:
            k = math.nan
        if not (1 <= k <= LIMIT_SCALE):
            raise ConfigError(f"{var}: expected a number from 1 to {LIMIT_SCALE:g}, got {value!r}")
        return k

    return parse


def priority(value: str) -> str:
    if value.lower() not in PRIORITIES:
        raise ConfigError(f"BUBBLETEA_COMPUTE_PRIORITY: expected low or normal, got {value.lower()!r}")
    return value.lower()


def plane_host(value: str) -> str:
    if value != "auto":
        return value
    name = socket.gethostname()
    try:
        return socket.gethostbyname(name)
    except OSError as exc:
        raise ConfigError(
            f"BUBBLETEA_PLANE_HOST is 'auto', but this host's name {name!r} does not resolve: {exc}"
        ) from None


def datacenter(draft: Draft, dc: str) -> None:
    if dc not in {d.name for d in draft.spec.datacenters}:
        names = ", ".join(d.name for d in draft.spec.datacenters)
        raise ConfigError(f"BUBBLETEA_DC: {dc!r} is not a datacenter of the spec (it has {names})")
    draft.settings["dc"] = dc


def decode(value: str) -> str:
    if value not in ("on", "off", "vllm"):
        raise ConfigError(f"BUBBLETEA_DECODE: expected on, off or vllm, got {value!r}")
    return value


def apply_decode(draft: Draft, value: str) -> None:
    engine = "vllm" if value == "vllm" else draft.spec.decode.engine
    decode = msgspec.structs.replace(draft.spec.decode, enabled=value != "off", engine=engine)
    draft.spec = msgspec.structs.replace(draft.spec, decode=decode)


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


def objective(value: str) -> object:
    return objective_ms(value, "BUBBLETEA_TTFT_OBJECTIVE_MS") if value.strip() else KEEP


def count(var: str, alternative: str = "") -> Callable[[str], int]:
    """A number of iterations, within what a spec may name (the environment bypasses the spec's own
    validation)."""

    def parse(value: str) -> int:
        if not value.isdigit() or not 1 <= int(value) <= MAX_ITERATIONS:
            raise ConfigError(f"{var}: expected a number from 1 to {MAX_ITERATIONS:,}{alternative}, got {value!r}")
        return int(value)

    return parse


def iterations(value: str) -> int | str:
    return UNTIL_STOPPED if value == UNTIL_STOPPED else count("BUBBLETEA_ITERATIONS", f" or {UNTIL_STOPPED!r}")(value)


def metrics_port(value: str) -> int | None:
    if value.lower() == "off":
        return None
    if not value.isdigit() or not 0 <= int(value) <= 65_535:
        raise ConfigError(f"BUBBLETEA_METRICS_PORT: expected a port number 0-65535 or 'off', got {value!r}")
    return int(value)
