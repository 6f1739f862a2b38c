"""Where a launcher starts the stage workers, by WAN mode (`wan.mode`, `--wan`).

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
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from urllib.parse import urlsplit, urlunsplit

from redis.asyncio import Redis

from shared.logs import get_logger
from shared.plan import placement_of
from shared.settings import Settings

log = get_logger(__name__)


@dataclass(frozen=True)
class WorkerLaunch:
    """How to start one stage worker: extra environment and a command prefix."""

    env: dict[str, str] = field(default_factory=dict)
    prefix: tuple[str, ...] = ()
    label: str = "stage_worker"


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
    from shared.kernel_net import plan_kernel_net, run_base

    check_privileges()  # one clear line (KernelWanError) without root / ip / tc
    host = urlsplit(redis_url).hostname or ""
    if host not in ("127.0.0.1", "localhost", "::1"):
        raise ValueError(
            f"--wan kernel reaches Redis from the namespaces through this host: REDIS_URL must be on "
            f"127.0.0.1 here (got host {host!r}); leave REDIS_URL unset to use the embedded Redis"
        )
    plan = plan_kernel_net(spec, settings.run, base=run_base(settings.run))
    placement = placement_of(spec)
    async with kernel_wan(plan):
        redis = Redis.from_url(redis_url, protocol=2)
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
