"""The prefill API handlers: OpenAI-compatible completions (prefill only) and the native async API.

Tested by: tests/integration/test_prefill_api.py, tests/integration/test_two_runs.py,
tests/unit/test_front_door_objective.py."""

from __future__ import annotations

import contextlib
import functools
import secrets
import time
from pathlib import Path
from typing import Any

import msgspec
from aiohttp import web

from services.prefill_queue.state import (
    BUS,
    DECODER_LOAD,
    GATE,
    HOPS,
    METRICS,
    ROUTING,
    SETTINGS,
    instance_results_stream,
    served_dcs,
)
from services.prefill_queue.validation import BadRequest, Limits, ParsedRequest, parse_native
from shared.bus.connection import TRANSIENT_ERRORS
from shared.config.model_info import CheckpointError, ModelInfo
from shared.config.spec import Prefill
from shared.control import serving, verdicts
from shared.control.health import live_instances
from shared.control.verdicts import Readiness
from shared.model.shape import max_prompt_tokens, model_info
from shared.model.tokenizer import Tokenizer, tokenizer_for
from shared.runtime.logs import get_logger
from shared.wire import PrefillRequest, PrefillResult, WireError, keys
from shared.wire.status import FailureReason, RequestStatus

log = get_logger(__name__)

#: How long a 429 tells the client to wait before retrying: about one pipeline iteration.
RETRY_AFTER_S = 1

#: The KV cache's format as the handle names it: safetensors with the layout `shared.dataplane.kvstore`
#: writes (`kvstore.KV_FORMAT`; the front door stays torch-free, so the name is repeated here and a
#: test keeps the two equal).
KV_HANDLE_FORMAT = "safetensors:bubbletea-kv/1"

#: How long a client whose request was failed with a 503 or 429 is told to wait (`Retry-After`).
FAILED_RETRY_AFTER_S = 5

#: The HTTP status of a request that was failed explicitly, by its reason (every reason has one).
FAILURE_STATUS: dict[FailureReason, int] = {
    FailureReason.DEADLINE: 504,  # no bubble had room in time: a gateway timeout, worth retrying later
    FailureReason.STATE_EXPIRED: 503,  # its partial prefill was lost: transient, retry
    FailureReason.MODEL_REFUSED: 500,  # the serving model cannot run an accepted prompt: our fault
    FailureReason.KV_MISSING: 503,  # the prompt's KV cache expired before the decoder took it: retry
    FailureReason.UNAVAILABLE: 503,  # training finished, stopped or stalled: no bubble will come soon
    FailureReason.OVERLOADED: 429,  # refused at once: the bubbles could not start it before its deadline
    FailureReason.PREFILL_ERROR: 500,  # the worker's prefill model failed running it: our fault (or the device's)
    FailureReason.TO_DECODER: 503,  # moved to a decoder this front door does not have (a config changed): retry
    FailureReason.DEAD_LETTERED: 500,  # the dispatcher could not handle it (a bug, or a foreign wire version)
}


async def not_serving(app: web.Application) -> Readiness | None:
    """The dispatcher's word that the bubbles cannot serve now (None: they can). A refusal is
    checked against a fresh read: the cached verdict may be a poll interval old."""
    v = app[GATE].refusal()
    if v is not None:
        await read_gate(app)
        v = app[GATE].refusal()
    return v


async def refuse_if_not_serving(app: web.Application) -> None:
    """503 with Retry-After and the reason, at once, when the dispatcher says nothing can serve."""
    v = await not_serving(app)
    if v is not None:
        app[METRICS].requests.labels("unavailable").inc()
        raise BadRequest(
            f"not serving: {v.reason}; retry after {v.retry_after_s}s",
            status=503,
            type_="service_unavailable",
            retry_after_s=v.retry_after_s,
        )


async def read_gate(app: web.Application) -> None:
    """Re-read the run's dispatchers' verdict now (a Redis error keeps the last one)."""
    with contextlib.suppress(*TRANSIENT_ERRORS):
        app[GATE].verdict = verdicts.combined(await verdicts.readiness(app[BUS].redis, app[SETTINGS].run))


async def read_routing(app: web.Application) -> None:
    """Re-read the datacenters' snapshots, with a dispatcher per datacenter (a Redis error keeps
    the last ones, which age out of the routing: `dc_routing.STALE_AFTER_S`)."""
    routing = app[ROUTING]
    if routing is not None:
        with contextlib.suppress(*TRANSIENT_ERRORS):
            await routing.read(app[BUS].redis)


async def read_decoders(app: web.Application) -> None:
    """Re-read whether one of the run's built-in decoder services is alive (a Redis error keeps the
    last answer): another run's reads another decode stream."""
    with contextlib.suppress(*TRANSIENT_ERRORS):
        decoders = await live_instances(app[BUS].redis, "decoder")
        app[GATE].decoder_live = any(d.get("run") == app[SETTINGS].run for d in decoders)


@functools.lru_cache(maxsize=4)
def served_model(spec: Prefill) -> tuple[ModelInfo, Tokenizer]:
    """The served model's shape and tokenizer (torch-free: a checkpoint directory's config.json and
    tokenizer.json, else `prefill.model` and bytes), read once per spec. `CheckpointError` if the
    checkpoint is missing or unusable."""
    if spec.checkpoint is not None and not Path(spec.checkpoint).exists():
        raise CheckpointError(
            f"prefill.checkpoint: {spec.checkpoint} does not exist (expected a Hugging Face model directory, or a "
            "state_dict file of prefill.model's shape)"
        )
    return model_info(spec), tokenizer_for(spec)


def limits(app: web.Application) -> Limits:
    spec = app[SETTINGS].spec
    info, tokenizer = served_model(spec.prefill)
    decoding = spec.decode.enabled and spec.prefill.kv_ttl_s > 0
    if not spec.decode.enabled:
        why = "this service does prefill only (decode.enabled is false: start it with bubbletea up --decode)"
    else:
        why = "decoding needs the KV cache, and prefill.kv_ttl_s is 0 (nothing is stored)"
    return Limits(
        model=spec.prefill.model_name,
        vocab=info.vocab,
        max_prompt_tokens=max_prompt_tokens(spec.prefill, info),
        default_timeout_s=spec.prefill.request_timeout_s,
        default_objective_s=spec.prefill.ttft_objective_ms / 1000 if spec.prefill.ttft_objective_ms else None,
        tokenizer=tokenizer,
        max_tokens=spec.decode.max_tokens if decoding else 1,
        max_model_len=info.max_model_len,
        prefill_only_because=why,
    )


async def read_json(request: web.Request) -> Any:
    try:
        return await request.json()
    except (ValueError, UnicodeDecodeError) as exc:
        raise BadRequest(f"the request body is not valid JSON: {exc}") from None


class Duplicate(Exception):
    """The client's Idempotency-Key was used before: `request_id` is what it created."""

    def __init__(self, request_id: str) -> None:
        super().__init__(request_id)
        self.request_id = request_id


async def enqueue(
    request: web.Request,
    parsed: ParsedRequest,
    request_id: str,
    idempotency_key: str | None = None,
    *,
    may_move: bool = False,
    received: float | None = None,
) -> PrefillRequest:
    """Accept and queue one prompt (429 past `max_queue_depth`; `Duplicate` for a used key).
    `may_move`: the decoder may compute it where the bubbles cannot by its objective; `received`:
    when the front door received it (`time.perf_counter()`; None: now)."""
    app = request.app
    req = new_request(app, parsed, request_id, may_move=may_move, received=received)
    settings = app[SETTINGS]
    routing, dc, claimed = app[ROUTING], None, None
    if routing is not None:
        dc, route = routing.place(req)
        if log.isEnabledFor(10):  # at debug: a line a request would cost the accept path its time
            log.debug("routed", id=request_id, dc=dc, why=route.why.value, detail=route.detail)
        if idempotency_key is not None:  # the key is the run's: claimed there, then accepted in `dc`'s tag
            try:
                claimed = await serving.claim_idempotency(app[BUS].redis, settings.run, idempotency_key, dc, request_id)
            except WireError as exc:  # the key names a request of another dispatch mode (a run restarted so)
                raise BadRequest(f"this Idempotency-Key cannot be reused here: {exc}", status=409) from None
            if claimed is not None:  # used before: that request, where it went (enqueued if it never was)
                dc, request_id = claimed
        req = msgspec.structs.replace(req, id=request_id, reply_to=instance_results_stream(app, dc))
    accepted = await serving.accept(
        app[BUS].redis,
        settings.run,
        req,
        settings.spec.prefill.max_queue_depth,
        idempotency_key=idempotency_key,
        dc=dc,
    )
    if isinstance(accepted, str):
        raise Duplicate(accepted)
    if claimed is not None and accepted:
        raise Duplicate(request_id)
    if not accepted:
        app[METRICS].requests.labels("rejected").inc()
        raise BadRequest(
            f"the queue is full ({app[SETTINGS].spec.prefill.max_queue_depth} requests waiting); "
            f"retry after {RETRY_AFTER_S}s",
            status=429,
            type_="rate_limit_error",
            retry_after_s=RETRY_AFTER_S,
        )
    return req


def new_request(
    app: web.Application, parsed: ParsedRequest, request_id: str, *, may_move: bool, received: float | None = None
) -> PrefillRequest:
    """The wire message of one validated prompt, its deadline counted from now and its objective
    from when it was received (`received`, perf_counter; None: now), less the front door's own hops
    (`FrontDoorHops`: what the dispatcher and the workers are given is the rest)."""
    now = time.time()
    objective = None
    if parsed.objective_s is not None:
        since = time.perf_counter() - received if received is not None else 0.0
        kept = app[HOPS].kept_s(parsed.objective_s)
        app[METRICS].hops_kept.set(kept)
        objective = now - since + parsed.objective_s - kept
    decoder = app.get(DECODER_LOAD)  # what the decoder took lately: kept for it if more than its reserve
    decoder_s = (decoder.predicted_s(now) or 0.0) if may_move and decoder is not None else 0.0
    return PrefillRequest(
        id=request_id,
        model=parsed.model,
        tokens=parsed.tokens,
        temperature=parsed.temperature,
        seed=parsed.seed,
        logprobs=parsed.logprobs,
        user=parsed.user,
        submitted=now,
        deadline=now + parsed.timeout_s,
        reply_to=instance_results_stream(app),
        objective=objective,
        may_move=may_move,
        decoder_s=decoder_s,
    )


async def submit(request: web.Request) -> web.Response:
    """POST /v1/prefill: 202 with an id at once; the same Idempotency-Key always returns the same id."""
    app = request.app
    parsed = parse_native(await read_json(request), limits(app))
    await refuse_if_not_serving(app)
    request_id = f"pf-{secrets.token_hex(12)}"
    idem = request.headers.get("Idempotency-Key")
    if idem is not None and not 1 <= len(idem) <= 200:
        raise BadRequest("the Idempotency-Key header must be 1-200 characters", param="Idempotency-Key")
    try:
        await enqueue(request, parsed, request_id, idem)
    except Duplicate as dup:
        return web.json_response(
            {"id": dup.request_id, "status": "duplicate"},
            status=200,
            headers={"Location": f"/v1/prefill/{dup.request_id}"},
        )
    return web.json_response(
        {"id": request_id, "status": RequestStatus.QUEUED},
        status=202,
        headers={"Location": f"/v1/prefill/{request_id}"},
    )


async def status(request: web.Request) -> web.Response:
    """GET /v1/prefill/{id}: queued, done (with the result) or failed (with the reason)."""
    request_id = request.match_info["id"]
    app = request.app
    where = await serving.find(app[BUS].redis, app[SETTINGS].run, request_id, served_dcs(app))
    if where is None:
        raise BadRequest(
            f"no request {request_id!r} (unknown, older than an hour, or answered and read more than "
            f"{keys.PREFILL_READ_GRACE_S}s ago)",
            status=404,
            type_="not_found_error",
        )
    dc, found = where
    body: dict[str, Any] = {"id": request_id, "status": found.status}
    r = found.result
    if r is not None:  # the client has its answer: its record goes within the grace
        await serving.read_by_client(app[BUS].redis, app[SETTINGS].run, [request_id], dc)
    if r is not None and r.ok:
        body["result"] = result_body(r)
    elif r is not None:
        body["error"], body["reason"] = r.error, r.reason
    return web.json_response(body)


async def models(request: web.Request) -> web.Response:
    name = request.app[SETTINGS].spec.prefill.model_name
    spec = request.app[SETTINGS].spec.prefill
    model = {
        "id": name,
        "object": "model",
        "created": 0,
        "owned_by": "bubbletea",
        "root": name,  # vLLM's benchmark reads the served model from here when --model is not given
        "parent": None,
        "max_model_len": max_prompt_tokens(spec, served_model(spec)[0]),
    }
    return web.json_response({"object": "list", "data": [model]})


def result_body(r: PrefillResult) -> dict[str, Any]:
    return {
        "token": r.token,
        "text": r.text,
        "logprob": r.logprob,
        "top_logprobs": [list(t) for t in r.top],
        "prompt_tokens": r.prompt_tokens,
        "kv_transfer_params": kv_params(r),
        "worker": r.worker,
        "queue_ms": r.queue_ms,
        "prefill_ms": r.prefill_ms,
    }


def kv_params(r: PrefillResult) -> dict[str, Any]:
    """Where a decode service fetches the prompt's KV cache, in vLLM's disaggregated-prefill shape
    (`do_remote_prefill`: the decode side takes over from a prefill done here) plus this system's
    handle (`store`, `key`, `format`, `bytes`, `expires_at`, `prompt_tokens`; docs/api.md, "The KV
    cache"): store "plane" = in the memory of the worker at `holder` ("host:port"), fetched over the
    data plane (`shared.dataplane.kv.KvClient`, or vLLM's BubbleTea connector: docs/vllm.md);
    "redis" = a Redis string of safetensors bytes at `key`
    (`shared.dataplane.kvstore.fetch_kv`). With `prefill.kv_ttl_s: 0`, or past the KV byte budget
    (`prefill.kv_budget_mb`), nothing is kept: the store is "none" and `why` says which."""
    vllm = {"do_remote_prefill": bool(r.kv_key), "do_remote_decode": False, "remote_engine_id": "bubbletea"}
    if not r.kv_key:
        none = {"store": "none", "key": None, "format": None, "bytes": 0, "expires_at": None}
        return {**vllm, **none, "why": r.kv_note or "no KV cache was stored"}
    handle = {"store": "plane" if r.kv_holder else "redis", "key": r.kv_key, "format": KV_HANDLE_FORMAT}
    if r.kv_holder:
        handle["holder"] = r.kv_holder
    # prompt_tokens: the positions the cache holds (vLLM's BubbleTea connector loads that many)
    return {**vllm, **handle, "bytes": r.kv_bytes, "expires_at": r.kv_expires_at, "prompt_tokens": r.prompt_tokens}
