"""Where a launcher starts the stage workers, by WAN mode (`wan.mode`, `--wan`).

Which mode: `--wan` (through `BUBBLETEA_WAN`), else the spec's `wan.mode`. A launcher whose
default is kernel where it can run (`bubbletea demo`) asks `launcher_wan_mode`, which only when
neither names one picks `kernel` or `model` (`kernel_wan.default_wan_mode`) and says why.

* `model` and `none`: as any service, on this host, any free slot each;
* `kernel`: each datacenter becomes a network namespace (`kernel_wan`), and the workers of a DC
  start inside it (`ip netns exec`), restricted to its slots (`BUBBLETEA_DC`), reaching Redis over
  their DC's link at the root namespace's address on that link, like a second host would. Redis
  (when it listens on loopback here) is told to listen there too for the run, and back after.

The namespaces, links and Redis's extra addresses are removed on the way out, also on failure and
Ctrl-C (the launcher cancels the task holding this context).
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

import yaml

from shared.bus.connection import client_for, is_cluster_url
from shared.config.settings import Settings
from shared.policies.pipeline_plan import placement_of
from shared.runtime.logs import get_logger

log = get_logger(__name__)


@dataclass(frozen=True)
class WorkerLaunch:
    """How to start one stage worker: extra environment and a command prefix."""

    env: dict[str, str] = field(default_factory=dict)
    prefix: tuple[str, ...] = ()
    label: str = "stage_worker"


def spec_names_wan_mode(path: Path) -> bool:
    """Whether the spec file itself names `wan.mode` (rather than leaving it to the default)."""
    raw = yaml.safe_load(Path(path).read_text())
    wan = raw.get("wan") if isinstance(raw, dict) else None
    return isinstance(wan, dict) and "mode" in wan


def launcher_wan_mode(settings: Settings, env: Mapping[str, str]) -> tuple[str, str, bool]:
    """(mode, why, defaulted) for a launcher whose default is `kernel` where it can run: `--wan`
    (`BUBBLETEA_WAN` in `env`) wins, then a `wan.mode` the spec file names; else `kernel` if this
    machine can build it and the run's Redis is the launcher's own (embedded: kernel mode rebinds
    its Redis to the namespaces' addresses for the run, not something to do to a server REDIS_URL
    names without being asked), otherwise `model`. `defaulted`: nothing named the mode."""
    if env.get("BUBBLETEA_WAN"):
        return settings.spec.wan.mode, "--wan", False
    if spec_names_wan_mode(settings.spec_path):
        return settings.spec.wan.mode, f"wan.mode in {settings.spec_path}", False
    if settings.redis_url:
        return "model", "REDIS_URL is set: kernel mode would rebind that Redis; --wan kernel to insist", True
    from bubbletea.launcher.kernel_wan import default_wan_mode

    mode, why = default_wan_mode()
    return mode, why, True


def _with_host(url: str, host: str) -> str:
    parts = urlsplit(url)
    auth = parts.netloc.rpartition("@")[0]
    netloc = (auth + "@" if auth else "") + f"{host}:{parts.port or 6379}"
    return urlunsplit((parts.scheme, netloc, parts.path, parts.query, parts.fragment))


@contextlib.asynccontextmanager
async def worker_launches(settings: Settings, redis_url: str) -> AsyncIterator[list[WorkerLaunch]]:
    """One `WorkerLaunch` per slot of the spec, valid while the context is open."""
    spec = settings.spec
    workers = spec.parallelism.pp * spec.parallelism.dp
    if spec.wan.mode != "kernel":
        yield [WorkerLaunch() for _ in range(workers)]
        return
    from bubbletea.launcher.kernel_wan import check_privileges, kernel_wan
    from shared.dataplane.kernel_net import plan_kernel_net, run_base

    check_privileges()  # one clear line (KernelWanError) without root / ip / tc
    if is_cluster_url(redis_url):
        raise ValueError(
            "--wan kernel rebinds the run's Redis for the namespaces (CONFIG SET bind): not done for a Redis "
            "Cluster: use --wan emulated with a cluster, or one Redis with --wan kernel"
        )
    host = urlsplit(redis_url).hostname or ""
    if host not in ("127.0.0.1", "localhost", "::1"):
        raise ValueError(
            f"--wan kernel reaches Redis from the namespaces through this host: REDIS_URL must be on "
            f"127.0.0.1 here (got host {host!r}); leave REDIS_URL unset to use the embedded Redis"
        )
    plan = plan_kernel_net(spec, settings.run, base=run_base(settings.run))
    placement = placement_of(spec)
    async with kernel_wan(plan):
        redis = client_for(redis_url, socket_timeout=None)  # see shared/bus/connection.py
        old_bind = str((await redis.config_get("bind")).get("bind") or "127.0.0.1")
        old_protected = str((await redis.config_get("protected-mode")).get("protected-mode") or "yes")
        controls = sorted({plan.control_address(dc.name) for dc in spec.datacenters})
        try:
            await redis.config_set("bind", " ".join(["127.0.0.1", *controls]))
            # Protected mode refuses every non-loopback client of a server without a password; the
            # extra addresses are this machine's private namespace links, reachable from nowhere else.
            await redis.config_set("protected-mode", "no")
            launches = []
            for dc in spec.datacenters:
                slots = sum(1 for k in range(spec.parallelism.pp) if placement.stage_dc[k] == dc.name)
                for _ in range(slots * spec.parallelism.dp):
                    launches.append(
                        WorkerLaunch(
                            env={
                                "REDIS_URL": _with_host(redis_url, plan.control_address(dc.name)),
                                "BUBBLETEA_DC": dc.name,
                            },
                            prefix=tuple(plan.netns_prefix(dc.name)),
                            label=f"worker@{dc.name}",
                        )
                    )
            log.info("kernel WAN ready", namespaces=",".join(plan.namespaces), redis_bind=" ".join(controls))
            yield launches
        finally:
            with contextlib.suppress(Exception):
                await redis.config_set("bind", old_bind)
                await redis.config_set("protected-mode", old_protected)
            await redis.aclose()
