"""The front door's operational endpoints: ``/health`` (Redis answers), ``/ready`` (requests can be
served, and if not why), ``/metrics`` (Prometheus) and ``/openapi.json``.

Tested by: tests/integration/test_readiness.py, tests/integration/test_prefill_queue_skeleton.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import Any

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from services.prefill_queue import api, completions, openapi
from services.prefill_queue.state import BUS, GATE, METRICS, SERVICE, SETTINGS, STARTED, WAITERS, served_dcs
from shared.bus.connection import TRANSIENT_ERRORS
from shared.control import serving
from shared.policies.prompt_placement import Mode
from shared.wire.status import ServingState

#: /health answers 503 if Redis does not answer a PING within this time.
HEALTH_REDIS_TIMEOUT_S = 1.0


async def _redis_ok(app: web.Application) -> str | None:
    """None if Redis answers a PING in time, else the reason."""
    try:
        async with asyncio.timeout(HEALTH_REDIS_TIMEOUT_S):  # not wait_for: see shared/bus/connection.py
            await app[BUS].redis.ping()
    except TRANSIENT_ERRORS as exc:  # includes TimeoutError
        app[METRICS].redis_up.set(0)
        return repr(exc)
    app[METRICS].redis_up.set(1)
    return None


async def health(request: web.Request) -> web.Response:
    """200 when this process can reach Redis; 503 (with the reason) when it cannot."""
    app = request.app
    body: dict[str, Any] = {"service": SERVICE, "uptime_s": round(time.time() - app[STARTED], 3)}
    problem = await _redis_ok(app)
    if problem is not None:
        return web.json_response({**body, "status": "unavailable", "redis": problem}, status=503)
    return web.json_response({**body, "status": "ok", "redis": "ok"})


async def ready(request: web.Request) -> web.Response:
    """200 when requests can be served: Redis answers, and a dispatcher says training is running
    with bubbles to fill. 503 otherwise, with the reason, the serving state and Retry-After."""
    app = request.app
    problem = await _redis_ok(app)
    if problem is not None:
        return web.json_response({"status": "not ready", "state": "redis", "reason": problem}, status=503)
    await api.read_gate(app)  # fresh, not up to a poll interval old: a probe asks rarely
    v = app[GATE].verdict
    if v is None:
        reason = "no dispatcher is running: requests are accepted but wait in the queue until one starts"
        return web.json_response({"status": "not ready", "state": "no_dispatcher", "reason": reason}, status=503)
    body = {"state": v.state.value, "reason": v.reason, "run": v.run}
    if not v.ready:
        headers = {"Retry-After": str(v.retry_after_s)}
        return web.json_response({"status": "not ready", **body}, status=503, headers=headers)
    if (v.state is ServingState.JOINING or not v.came_round) and _objective_waits_for_training(app):
        until = "its first bubble" if v.state is ServingState.JOINING else "the pipeline has come round once"
        body["reason"] = f"{v.reason}; until {until} a request with a TTFT objective is refused (429)"
        return web.json_response({"status": "not ready", **body}, status=503, headers={"Retry-After": "1"})
    return web.json_response({"status": "ready", **body})


def _objective_waits_for_training(app: web.Application) -> bool:
    """Whether this front door's requests (its default TTFT objective, no decoder to compute them)
    are refused while the run's workers set up, and until the pipeline has come round once: the
    dispatcher cannot say when the first bubble comes, nor then how fast the bubbles serve
    (`prompt_placement.on_arrival`). /ready says 503 then, so that a probe (compose's
    healthcheck, Kubernetes') sends traffic once it would be served."""
    objective = app[SETTINGS].spec.prefill.ttft_objective_ms
    return bool(objective) and completions.default_mode(app) is Mode.BUBBLES


async def metrics(request: web.Request) -> web.Response:
    m = request.app[METRICS]
    with contextlib.suppress(*TRANSIENT_ERRORS):  # if Redis is down the gauge keeps its last value
        app = request.app
        m.waiting.set(await serving.inflight(app[BUS].redis, app[SETTINGS].run, served_dcs(app)))
    m.running.labels(m.model_name).set(len(request.app[WAITERS]))
    return web.Response(body=generate_latest(m.registry), headers={"Content-Type": CONTENT_TYPE_LATEST})


async def openapi_json(request: web.Request) -> web.Response:
    p = request.app[SETTINGS].spec.prefill
    return web.json_response(openapi.spec(p.model_name, api.limits(request.app).max_prompt_tokens))
