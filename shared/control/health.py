"""Liveness through Redis: each service instance refreshes a key with a TTL (arq's habit).

A key that expires means the instance stopped beating: crashed, hung or cut off from Redis.
The launcher and operators list live instances with `live_instances`.
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
import time
from collections.abc import Callable
from typing import Any

from redis.asyncio import Redis, RedisCluster

from shared.bus.connection import TRANSIENT_ERRORS, Client, Outage
from shared.runtime.logs import get_logger
from shared.wire import keys

log = get_logger(__name__)

HEARTBEAT_INTERVAL_S = 2.0


def instance_id() -> str:
    return f"{socket.gethostname()}-{os.getpid()}"


class Heartbeat:
    """Beats once at `start` (so a started service is visible at once), then every interval."""

    def __init__(
        self,
        r: Redis,
        service: str,
        instance: str,
        info: Callable[[], dict[str, Any]],
        interval_s: float = HEARTBEAT_INTERVAL_S,
    ) -> None:
        self.r, self.service, self.instance, self.info, self.interval_s = r, service, instance, info, interval_s
        self.key = keys.health_key(service, instance)
        self.started = time.time()
        self._task: asyncio.Task[None] | None = None
        #: A Redis outage never stops the beating: one warning when beats start failing, one info
        #: when one lands again (the key may have expired meanwhile: "gone" until then).
        self.outage = Outage(f"heartbeat of {service}")

    async def beat(self) -> None:
        body = {
            "service": self.service,
            "instance": self.instance,
            "pid": os.getpid(),
            "started": self.started,
            "ts": time.time(),
            **self.info(),
        }
        try:
            await self.r.set(self.key, json.dumps(body), px=int(self.interval_s * keys.HEALTH_TTL_BEATS * 1000))
        except TRANSIENT_ERRORS as exc:
            self.outage.failed(exc)
        else:
            self.outage.ok()

    async def start(self) -> None:
        await self.beat()
        self._task = asyncio.create_task(self._loop(), name=f"heartbeat:{self.service}")

    async def stop(self) -> None:
        """Stop beating and delete the key (it would expire by itself within its TTL anyway)."""
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        try:
            await self.r.delete(self.key)
        except TRANSIENT_ERRORS:
            log.warning("could not delete health key; it expires by itself", key=self.key)

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)  # periodic by nature
            await self.beat()


async def live_instances(r: Client, service: str | None = None) -> list[dict[str, Any]]:
    """Every instance (of `service`, if given) whose health key has not expired, sorted by service.
    On a Redis Cluster the SCAN runs on every master (the keys spread over their slots)."""
    out = []
    every_master: dict[str, Any] = {"target_nodes": RedisCluster.PRIMARIES} if isinstance(r, RedisCluster) else {}
    async for key in r.scan_iter(match=keys.HEALTH_KEY_PATTERN, count=500, **every_master):
        raw = await r.get(key)
        if raw:
            inst = json.loads(raw)
            if service is None or inst["service"] == service:
                out.append(inst)
    return sorted(out, key=lambda d: (d["service"], d["instance"]))


async def wait_live(r: Redis, service: str, timeout_s: float) -> None:
    """Wait until `service` has a live heartbeat; TimeoutError after `timeout_s`."""
    async with asyncio.timeout(timeout_s):
        while not await live_instances(r, service):  # noqa: ASYNC110
            await asyncio.sleep(0.05)  # heartbeats are keys with TTLs: there is no event to wait on
