"""The prefill_queue app: `create_app(settings)` builds it; tests drive it through aiohttp's test client.

Routes: the OpenAI-compatible ``POST /v1/completions`` and ``POST /v1/chat/completions`` (the
messages rendered with the model's chat template), the native asynchronous
``POST /v1/prefill`` and ``GET /v1/prefill/{id}``, ``GET /v1/models``, ``/health``, ``/ready``,
``/metrics`` and ``/openapi.json`` (`probes`), and the run's live page ``/dashboard`` (`dashboard`).
Accepted requests go to the request stream; answers come back on this instance's results stream
(see `shared.control.serving`).

Tested by: tests/integration/test_prefill_queue_skeleton.py, tests/integration/test_readiness.py,
tests/integration/test_hostile_clients.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from aiohttp import web
from aiohttp.hdrs import CONTENT_TYPE

from services.prefill_queue import api, chat, completions, dashboard, on_decoder, probes
from services.prefill_queue.metrics import Metrics
from services.prefill_queue.routing import DcRouting
from services.prefill_queue.state import (
    BUS,
    DECODERS_EVERY_S,
    GATE,
    HOPS,
    INSTANCE,
    METRICS,
    READ_EVERY_S,
    ROUTING,
    SERVICE,
    SETTINGS,
    STARTED,
    STOP_GRACE_S,
    STOPPING,
    VLLM,
    WAITERS,
    Gate,
    Stopping,
    Waiters,
    instance_results_stream,
    served_dcs,
)
from services.prefill_queue.validation import MAX_JSON_DEPTH, BadRequest, json_too_deep
from services.prefill_queue.vllm_decode import VllmDecoder
from shared.bus import Bus, Delivery
from shared.bus.connection import TRANSIENT_ERRORS
from shared.bus.delivery import Handlers
from shared.config.settings import Settings
from shared.control import serving, verdicts
from shared.control.health import Heartbeat, instance_id
from shared.policies.dc_routing import publish_every_s
from shared.policies.pipeline_plan import dispatch_dcs
from shared.policies.prefill_cost import PrefillCostModel
from shared.policies.prompt_placement import FrontDoorHops
from shared.runtime.auth import bearer_ok
from shared.runtime.logs import get_logger
from shared.wire import DecodeChunk, PrefillResult
from shared.wire.status import RequestStatus

#: Retry-After of the 503 a request gets while Redis does not answer (a restart takes seconds).
REDIS_DOWN_RETRY_AFTER_S = 2
log = get_logger(__name__)


def routing_of(settings: Settings) -> DcRouting | None:
    """The front door's routing across datacenters, with a dispatcher for each (else None)."""
    dcs = [dc for dc in dispatch_dcs(settings.spec) if dc is not None]
    return DcRouting(settings.run, dcs, PrefillCostModel.scaled(settings.time_scale)) if dcs else None


def create_app(settings: Settings) -> web.Application:
    app = web.Application(
        client_max_size=settings.spec.prefill.max_body_bytes,
        middlewares=[_request_id, _json_errors, _count_requests, _stopping, _api_key, _json_body],
    )
    app[SETTINGS] = settings
    api.served_model(settings.spec.prefill)  # an unusable checkpoint directory stops the start, naming why
    chat.served_template(settings.spec.prefill)  # so does a chat template that cannot be read or compiled
    app[METRICS] = Metrics(settings.spec.prefill.model_name)
    app[STARTED] = time.time()
    app[WAITERS] = Waiters()
    app[INSTANCE] = f"{instance_id()}-{secrets.token_hex(3)}"
    app[GATE] = Gate()
    app[STOPPING] = Stopping()
    app[HOPS] = FrontDoorHops()
    app[ROUTING] = routing_of(settings)
    d = settings.spec.decode
    app[VLLM] = VllmDecoder(d) if d.enabled and d.engine == "vllm" else None
    on_decoder.setup(app)
    app.on_shutdown.append(_begin_stopping)
    app.cleanup_ctx.append(_bus_ctx)
    dashboard.setup(app)  # its reader starts before the results consumer that feeds it answers
    app.cleanup_ctx.append(_heartbeat_ctx)
    app.cleanup_ctx.append(_results_ctx)
    app.cleanup_ctx.append(_gate_ctx)
    app.cleanup_ctx.append(_vllm_ctx)
    app.router.add_post("/v1/completions", completions.completions)
    app.router.add_post("/v1/chat/completions", chat.chat_completions)
    app.router.add_post("/v1/prefill", api.submit)
    app.router.add_get("/v1/prefill/{id}", api.status)
    app.router.add_get("/v1/models", api.models)
    app.router.add_get("/health", probes.health)
    app.router.add_get("/ready", probes.ready)
    app.router.add_get("/metrics", probes.metrics)
    app.router.add_get("/openapi.json", probes.openapi_json)
    return app


# --- lifecycle (started in order, stopped in reverse) --------------------------------------


async def _bus_ctx(app: web.Application) -> AsyncIterator[None]:
    # ride_out_s=0: a request that needs Redis while it is down gets a 503 once the client's own
    # few retries give up (seconds), rather than waiting out the outage.
    bus = Bus(app[SETTINGS].require_redis_url(), app[SETTINGS].spec.bus, name=SERVICE, ride_out_s=0)
    app[BUS] = bus
    yield
    await bus.aclose()


async def _vllm_ctx(app: web.Application) -> AsyncIterator[None]:
    vllm = app[VLLM]
    if vllm is not None:
        log.info("decoding on vLLM", url=vllm.url, model=vllm.model or "(the first it serves)")
    yield
    if vllm is not None:
        await vllm.close()


async def _heartbeat_ctx(app: web.Application) -> AsyncIterator[None]:
    hb = Heartbeat(app[BUS].redis, SERVICE, app[INSTANCE], lambda: {"waiting": len(app[WAITERS])})
    await hb.start()
    yield
    await hb.stop()


async def _results_ctx(app: web.Application) -> AsyncIterator[None]:
    """Answers to this instance's requests wake the waiting HTTP handlers."""
    m = app[METRICS]

    def on_result(dc: str | None) -> Callable[[Delivery], Awaitable[None]]:
        async def handle(d: Delivery) -> None:
            r = d.message
            assert isinstance(r, PrefillResult)  # the handler table routes only this kind here
            m.requests.labels("success" if r.ok else "moved" if r.status is RequestStatus.MOVED else "failed").inc()
            if r.ok:
                m.placed_prompt(r.placement, r.prompt_tokens, (r.queue_ms + r.prefill_ms) / 1000)
                m.prompt_tokens.labels(m.model_name).inc(r.prompt_tokens)
                m.request_prompt_tokens.labels(m.model_name).observe(r.prompt_tokens)
                m.queue_time.observe(r.queue_ms / 1000)
                m.prefill_time.observe(r.prefill_ms / 1000)
                m.ttft.observe((r.queue_ms + r.prefill_ms) / 1000)  # submission to the answer
            app[WAITERS].deliver(r, dc)
            app[dashboard.DASHBOARD].on_result(r)

        return handle

    async def on_chunk(d: Delivery) -> None:
        chunk = d.message
        assert isinstance(chunk, DecodeChunk)
        app[WAITERS].deliver_chunk(chunk)

    # The run's stream (the decoder's chunks; the answers, with one dispatcher), and with a
    # dispatcher per datacenter one in each datacenter's tag, where its answers are written.
    streams: dict[str | None, Handlers] = {None: {PrefillResult: on_result(None), DecodeChunk: on_chunk}}
    streams.update({dc: {PrefillResult: on_result(dc)} for dc in served_dcs(app) if dc is not None})
    async with contextlib.AsyncExitStack() as consumers:
        for dc, handlers in streams.items():
            stream = instance_results_stream(app, dc)
            await consumers.enter_async_context(app[BUS].consumer(stream, SERVICE, handlers, name=app[INSTANCE]))
        marking = asyncio.create_task(_mark_read(app), name="mark-read")
        try:
            yield
        finally:
            marking.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await marking
            await _mark_read_once(app)  # what was delivered last still goes within the grace


async def _mark_read_once(app: web.Application) -> None:
    for dc, read in app[WAITERS].take_read().items():
        try:
            await serving.read_by_client(app[BUS].redis, app[SETTINGS].run, read, dc)
        except TRANSIENT_ERRORS as exc:
            # Redis away: those records keep their hour (bounded memory, nothing lost); not retried
            log.warning("could not mark answers read; their records keep their hour", count=len(read), error=repr(exc))


async def _mark_read(app: web.Application) -> None:
    """Every `READ_EVERY_S`, the answers delivered since are marked read (`keys.PREFILL_READ_GRACE_S`)."""
    while True:
        await asyncio.sleep(READ_EVERY_S)
        await _mark_read_once(app)


async def _gate_ctx(app: web.Application) -> AsyncIterator[None]:
    """Keep the dispatchers' readiness verdict fresh (read every `verdicts.READINESS_EVERY_S`)."""

    spec = app[SETTINGS].spec
    builtin_decoder = spec.decode.enabled and app[VLLM] is None  # prompts may be placed on it if alive

    async def watch() -> None:
        gate = app[GATE]
        decoders_read = time.monotonic()
        while True:
            was = gate.verdict.state.value if gate.verdict else "no dispatcher"
            await api.read_gate(app)  # a Redis error keeps the last verdict; /ready reports Redis
            now = gate.verdict.state.value if gate.verdict else "no dispatcher"
            if now != was:
                log.info("serving state", state=now, reason=gate.verdict.reason if gate.verdict else "")
            if builtin_decoder and time.monotonic() - decoders_read >= DECODERS_EVERY_S:
                had = gate.decoder_live
                await api.read_decoders(app)
                decoders_read = time.monotonic()
                if gate.decoder_live != had:
                    log.info("decoder for prompts", alive=gate.decoder_live)
            await asyncio.sleep(verdicts.READINESS_EVERY_S)  # a poll: the verdict is a key with a TTL

    async def route() -> None:  # with a dispatcher per datacenter: their snapshots, as often as published
        every_s = publish_every_s(app[SETTINGS].time_scale, verdicts.READINESS_EVERY_S)
        while True:
            await asyncio.sleep(every_s)
            await api.read_routing(app)

    await api.read_gate(app)
    await api.read_routing(app)
    if builtin_decoder:
        await api.read_decoders(app)
    tasks = [asyncio.create_task(watch(), name="readiness")]
    if app[ROUTING] is not None:
        tasks.append(asyncio.create_task(route(), name="routing"))
    yield
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


# --- middlewares ---------------------------------------------------------------------------

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


@web.middleware
async def _request_id(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Echo the client's X-Request-Id (or give one), on every response."""
    rid = request.headers.get("X-Request-Id") or secrets.token_hex(8)
    resp = await handler(request)
    resp.headers["X-Request-Id"] = rid
    return resp


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
    except BadRequest as exc:
        status = exc.status
        raise
    except TRANSIENT_ERRORS:
        status = 503  # `_json_errors` answers Redis being away with a 503
        raise
    finally:
        m = request.app[METRICS]
        m.http_requests.labels(route, request.method, str(status)).inc()
        m.http_latency.labels(route).observe(time.perf_counter() - t0)


@web.middleware
async def _api_key(request: web.Request, handler: Handler) -> web.StreamResponse:
    settings = request.app[SETTINGS]
    key = settings.api_key
    guarded = request.path.startswith("/v1/") or (settings.metrics_auth and request.path == "/metrics")
    if key and guarded and not bearer_ok(request.headers.get("Authorization", ""), key):
        raise BadRequest(
            "missing or wrong API key: send 'Authorization: Bearer <key>'", status=401, type_="authentication_error"
        )
    return await handler(request)


async def _begin_stopping(app: web.Application) -> None:
    """aiohttp calls this once the listening socket is closed and before it waits for the handlers
    in flight: they get their answer within the grace period, or a 503 (see `state.Stopping`)."""
    log.info("stopping: no new requests; answering those in flight", grace_s=STOP_GRACE_S, waiting=len(app[WAITERS]))
    app[STOPPING].set()


@web.middleware
async def _stopping(request: web.Request, handler: Handler) -> web.StreamResponse:
    """While stopping, a new request on a connection still open is refused at once (503, JSON)."""
    if request.app[STOPPING].event.is_set() and request.path.startswith("/v1/"):
        raise BadRequest(
            "this front door is stopping: send the request to another instance",
            status=503,
            type_="service_unavailable",
            retry_after_s=1,
        )
    return await handler(request)


@web.middleware
async def _json_body(request: web.Request, handler: Handler) -> web.StreamResponse:
    """A POST body must be JSON (415 otherwise; a missing Content-Type is read as JSON) nested at
    most `MAX_JSON_DEPTH` deep (400 otherwise), checked before any handler parses it. The body read
    here is cached by aiohttp, so the handler's `request.json()` does not read it again."""
    if request.method != "POST" or request.match_info.http_exception is not None:
        return await handler(request)
    if CONTENT_TYPE in request.headers and request.content_type != "application/json":
        raise BadRequest(
            f"the request body must be JSON, sent with 'Content-Type: application/json'; got {request.content_type!r}",
            param="Content-Type",
            status=415,
        )
    if json_too_deep(await request.read()):
        raise BadRequest(f"the request body's JSON is nested deeper than {MAX_JSON_DEPTH} levels")
    return await handler(request)


@web.middleware
async def _json_errors(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Every error is JSON in the OpenAI error shape, so clients parse one format. Client errors
    are logged in one line at info; Redis not answering (`TRANSIENT_ERRORS`) is a 503
    `service_unavailable` with Retry-After; an unexpected exception is logged with its traceback
    and answered as a JSON 500."""
    try:
        return await handler(request)
    except BadRequest as exc:
        headers = {"Retry-After": str(exc.retry_after_s)} if exc.retry_after_s is not None else None
        message = exc.message
        resp = error_response(exc.status, message, type_=exc.type, param=exc.param, headers=headers)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        message = exc.reason if exc.text is None or exc.text.startswith(str(exc.status)) else exc.text
        type_ = "invalid_request_error"
        if isinstance(exc, web.HTTPNotFound):
            type_ = "not_found_error"  # the message stays "Not Found" (a test pins it); the log names the path
        elif isinstance(exc, web.HTTPMethodNotAllowed):
            allowed = ", ".join(sorted(exc.allowed_methods))
            message = f"method {exc.method} is not allowed on {request.path}; allowed: {allowed}"
        elif exc.status == 413:
            message = f"the request body is larger than {request.app[SETTINGS].spec.prefill.max_body_bytes} bytes"
        resp = error_response(exc.status, message, type_=type_, headers=exc.headers)
    except TRANSIENT_ERRORS as exc:
        if request.writer.output_size > 0:
            raise  # a stream already started: aiohttp closes the connection
        message = f"Redis, the queue behind this service, is not answering ({type(exc).__name__}): retry shortly"
        headers = {"Retry-After": str(REDIS_DOWN_RETRY_AFTER_S)}
        resp = error_response(503, message, type_="service_unavailable", headers=headers)
    except Exception as exc:
        if request.writer.output_size > 0:
            raise  # a stream already started: aiohttp closes the connection
        log.exception("request failed", method=request.method, path=request.path, error=repr(exc))
        resp = error_response(500, "internal error: the request failed on the server", type_="server_error")
        return resp
    # One line per error answer: info for a client's error, warning for a 5xx; never a traceback.
    (log.info if resp.status < 500 else log.warning)(
        "error answer", method=request.method, path=request.path, status=resp.status, error=message
    )
    return resp


def error_response(
    status: int, message: str, *, type_: str = "invalid_request_error", param: str | None = None, headers: Any = None
) -> web.Response:
    body = {"error": {"message": message, "type": type_, "param": param, "code": status}}
    hdrs = {k: v for k, v in (headers or {}).items() if k.lower() not in ("content-type", "content-length")}
    return web.json_response(body, status=status, headers=hdrs)
