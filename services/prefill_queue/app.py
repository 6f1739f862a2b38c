"""The prefill_queue app: `create_app(settings)` builds it; tests drive it through aiohttp_client.

Foundation scope: `/health` and `/metrics`, the bus connection and the heartbeat. The prefill API
(OpenAI-compatible and native) is added on top of this skeleton.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from services.prefill_queue.metrics import Metrics
from shared.bus import Bus
from shared.bus.connection import TRANSIENT_ERRORS
from shared.health import Heartbeat, instance_id
from shared.logs import get_logger
from shared.settings import Settings

SERVICE = "prefill_queue"
SETTINGS = web.AppKey("settings", Settings)
BUS = web.AppKey("bus", Bus)
METRICS = web.AppKey("metrics", Metrics)
STARTED = web.AppKey("started", float)

#: /health answers 503 if Redis does not answer a PING within this time.
HEALTH_REDIS_TIMEOUT_S = 1.0

log = get_logger(__name__)


def create_app(settings: Settings) -> web.Application:
    app = web.Application(
        client_max_size=settings.spec.prefill.max_body_bytes, middlewares=[_json_errors, _count_requests]
    )
    app[SETTINGS] = settings
    app[METRICS] = Metrics()
    app[STARTED] = time.time()
    app.cleanup_ctx.append(_bus_ctx)
    app.cleanup_ctx.append(_heartbeat_ctx)
    app.router.add_get("/health", health)
    app.router.add_get("/metrics", metrics)
    return app


# --- lifecycle (started in order, stopped in reverse) --------------------------------------


async def _bus_ctx(app: web.Application) -> AsyncIterator[None]:
    bus = Bus(app[SETTINGS].require_redis_url(), app[SETTINGS].spec.bus, name=SERVICE)
    app[BUS] = bus
    yield
    await bus.aclose()


async def _heartbeat_ctx(app: web.Application) -> AsyncIterator[None]:
    hb = Heartbeat(app[BUS].redis, SERVICE, instance_id(), lambda: {})
    await hb.start()
    yield
    await hb.stop()


# --- middlewares ---------------------------------------------------------------------------

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


@web.middleware
async def _count_requests(request: web.Request, handler: Handler) -> web.StreamResponse:
    route = request.match_info.route.resource.canonical if request.match_info.route.resource else "unmatched"
    t0 = time.perf_counter()
    status = 500
    try:
        resp = await handler(request)
        status = resp.status
        return resp
    except web.HTTPException as exc:
        status = exc.status
        raise
    finally:
        m = request.app[METRICS]
        m.http_requests.labels(route, request.method, str(status)).inc()
        m.http_latency.labels(route).observe(time.perf_counter() - t0)


@web.middleware
async def _json_errors(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Every error is JSON in the OpenAI error shape, so clients parse one format."""
    try:
        return await handler(request)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        return error_response(
            exc.status,
            exc.reason if exc.text is None or exc.text.startswith(str(exc.status)) else exc.text,
            headers=exc.headers,
        )


def error_response(
    status: int, message: str, *, type_: str = "invalid_request_error", param: str | None = None, headers: Any = None
) -> web.Response:
    body = {"error": {"message": message, "type": type_, "param": param, "code": status}}
    hdrs = {k: v for k, v in (headers or {}).items() if k.lower() not in ("content-type", "content-length")}
    return web.json_response(body, status=status, headers=hdrs)


# --- handlers ------------------------------------------------------------------------------


async def health(request: web.Request) -> web.Response:
    """200 when this process can reach Redis; 503 (with the reason) when it cannot."""
    app = request.app
    body: dict[str, Any] = {"service": SERVICE, "uptime_s": round(time.time() - app[STARTED], 3)}
    try:
        async with asyncio.timeout(HEALTH_REDIS_TIMEOUT_S):  # not wait_for: see shared/bus/connection.py
            await app[BUS].redis.ping()
    except TRANSIENT_ERRORS as exc:  # includes TimeoutError
        app[METRICS].redis_up.set(0)
        return web.json_response({**body, "status": "unavailable", "redis": repr(exc)}, status=503)
    app[METRICS].redis_up.set(1)
    return web.json_response({**body, "status": "ok", "redis": "ok"})


async def metrics(request: web.Request) -> web.Response:
    data = generate_latest(request.app[METRICS].registry)
    return web.Response(body=data, headers={"Content-Type": CONTENT_TYPE_LATEST})
