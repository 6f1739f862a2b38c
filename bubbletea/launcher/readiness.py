"""When `bubbletea up`'s services are healthy and serving is ready, and where their /metrics are.

A wait raises `ServiceFailed` naming what did not come in time, or the process that died meanwhile
(with its last lines).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import Callable
from pathlib import Path
from urllib.parse import urlsplit

import aiohttp

from bubbletea.launcher.procs import Proc, ServiceFailed, wait_http_healthy
from shared.bus import Bus
from shared.config.settings import Settings
from shared.control.health import live_instances
from shared.wire.status import ServingState

#: How long every service gets to report healthy, and then serving to be ready.
HEALTHY_TIMEOUT_S = 90.0
READY_TIMEOUT_S = 90.0


async def wait_healthy(procs: list[Proc], url: str, settings: Settings, api: str, say: Callable[[str], None]) -> None:
    """The front door answers /health; every other service has a heartbeat (workers: one each)."""
    for p in procs:
        if p.svc.http:
            await wait_http_healthy(p, api, timeout=HEALTHY_TIMEOUT_S)
    want: dict[str, int] = {}
    for p in procs:
        if not p.svc.http:
            want[p.svc.name] = want.get(p.svc.name, 0) + 1
    deadline = time.monotonic() + HEALTHY_TIMEOUT_S
    async with Bus(url, settings.spec.bus, name="up") as bus:
        while True:
            raise_if_dead(procs)
            live = await live_instances(bus.redis)
            have: dict[str, int] = {}
            for inst in live:
                if inst["service"] in want and inst.get("run", settings.run) == settings.run:
                    have[inst["service"]] = have.get(inst["service"], 0) + 1
            missing = {n: k - have.get(n, 0) for n, k in want.items() if have.get(n, 0) < k}
            if not missing:
                for name in want:
                    say(f"==> {name} healthy ({have[name]})")
                return
            if time.monotonic() > deadline:
                raise ServiceFailed(f"not healthy within {HEALTHY_TIMEOUT_S:.0f}s: {missing}")
            await asyncio.sleep(0.2)  # heartbeats are TTL keys: nothing to wait on but time


async def wait_restarted(p: Proc, url: str, settings: Settings, api: str) -> None:
    """A restarted process is healthy: the front door answers /health, another service has a
    heartbeat from its new pid. Returns early if it died again (the supervisor sees that death)."""
    if p.svc.http:
        try:
            await wait_http_healthy(p, api, timeout=HEALTHY_TIMEOUT_S)
        except ServiceFailed:
            if p.proc.returncode is None:
                raise  # alive but not healthy in time
        return
    deadline = time.monotonic() + HEALTHY_TIMEOUT_S
    async with Bus(url, settings.spec.bus, name="up") as bus:
        while p.proc.returncode is None:
            live = await live_instances(bus.redis, p.svc.name)
            if any(inst.get("pid") == p.proc.pid for inst in live):
                return
            if time.monotonic() > deadline:
                raise ServiceFailed(
                    f"{p.label} (pid {p.proc.pid}) restarted but not healthy within {HEALTHY_TIMEOUT_S:.0f}s"
                )
            await asyncio.sleep(0.2)  # heartbeats are TTL keys: nothing to wait on but time


async def wait_ready(procs: list[Proc], api: str, say: Callable[[str], None]) -> str:
    """Poll the front door's /ready until 200 with training running (a dispatcher fills its
    bubbles): `joining`, requests already taken while the workers set up, is not yet "up". The last
    reason is in the error if it never comes. Returns the serving state's reason."""
    deadline = time.monotonic() + READY_TIMEOUT_S
    last = "no answer"
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=3)) as http:
        while True:
            raise_if_dead(procs)
            with contextlib.suppress(aiohttp.ClientError, TimeoutError):
                async with http.get(f"{api}/ready") as resp:
                    body = await resp.json()
                    if resp.status == 200 and body.get("state") != ServingState.JOINING:
                        say("==> serving ready")
                        return str(body.get("reason", "ready"))
                    last = str(body.get("reason", body))
            if time.monotonic() > deadline:
                raise ServiceFailed(f"serving not ready within {READY_TIMEOUT_S:.0f}s: {last}")
            await asyncio.sleep(0.2)  # readiness is a verdict re-published every 0.25 s: poll it


async def metrics_endpoints(
    url: str, settings: Settings, api: str, pids: set[int] | None = None
) -> list[tuple[str, str]]:
    """(label, /metrics URL) of every service: the front door's API, the others' heartbeats (only
    those of `pids` if given: a killed process's heartbeat outlives it by its TTL)."""
    out = [("prefill_queue", f"{api}/metrics")]
    async with Bus(url, settings.spec.bus, name="up") as bus:
        live = await live_instances(bus.redis)
    for inst in live:
        if pids is not None and inst.get("pid") not in pids:
            continue
        if inst.get("metrics_url") and inst.get("run", settings.run) == settings.run:
            label = inst["service"] + (f"-{inst['slot']}" if inst.get("slot") else "")
            out.append((label, inst["metrics_url"]))
    return out


def write_targets(path: Path, endpoints: list[tuple[str, str]]) -> None:
    """Prometheus `file_sd_configs` targets: one group per endpoint, labelled with its service."""
    groups = []
    for label, metrics_url in endpoints:
        u = urlsplit(metrics_url)
        groups.append({"targets": [u.netloc], "labels": {"job": label.split("-")[0], "bubbletea_service": label}})
    path.write_text(json.dumps(groups, indent=2))


def raise_if_dead(procs: list[Proc]) -> None:
    for p in procs:
        if p.proc.returncode is not None and p.proc.returncode != 0:
            raise ServiceFailed(
                f"{p.label} (pid {p.proc.pid}) exited with code {p.proc.returncode}; last output:\n" + "\n".join(p.tail)
            )
