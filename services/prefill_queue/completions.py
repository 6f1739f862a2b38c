"""POST /v1/completions: the OpenAI completions API as the official client and `vllm bench serve` speak it.

Each prompt of the request is queued on its own and answered with its first token (prefill only).
Without streaming the answer is one JSON body with a choice per prompt. With ``stream: true`` it is
server-sent events: one chunk per prompt as its answer lands (the token, its logprobs and its
finish reason), a usage chunk when ``stream_options.include_usage`` is set, then ``data: [DONE]``.
The stream starts only once the first answer is in, so a request that fails before anything was
sent still gets its HTTP error status; a failure after that is an ``error`` event.
"""

from __future__ import annotations

import asyncio
import json
import re
import secrets
import time
from collections.abc import AsyncIterator
from typing import Any

from aiohttp import web

from services.prefill_queue.api import (
    FAILED_RETRY_AFTER_S,
    FAILURE_STATUS,
    enqueue,
    kv_params,
    limits,
    refuse_if_not_serving,
)
from services.prefill_queue.state import METRICS, SETTINGS, WAITERS
from services.prefill_queue.validation import BadRequest, Completion, parse_completion
from shared.model.tokenizer import decode
from shared.wire import PrefillRequest, PrefillResult

#: An X-Request-Id a client sends becomes the completion's id (as vLLM does): printable, bounded.
REQUEST_ID = re.compile(r"[A-Za-z0-9._:\-]{1,128}")


async def completions(request: web.Request) -> web.StreamResponse:
    app = request.app
    received = time.perf_counter()
    try:
        body = await request.json()
    except (ValueError, UnicodeDecodeError) as exc:
        raise BadRequest(f"the request body is not valid JSON: {exc}") from None
    c = parse_completion(body, limits(app))
    await refuse_if_not_serving(app)  # once for all the prompts: none is queued if the answer is no
    completion_id = _completion_id(request)
    ids = [completion_id] if len(c.prompts) == 1 else [f"{completion_id}-{i}" for i in range(len(c.prompts))]
    waiters = {rid: app[WAITERS].expect(rid) for rid in ids}
    try:
        reqs = [await enqueue(request, parsed, rid) for parsed, rid in zip(c.prompts, ids, strict=True)]
        answers = _as_answered(waiters, c.prompts[0].timeout_s)
        if c.stream:
            return await _stream(request, received, c, completion_id, reqs, answers)
        results: dict[str, PrefillResult] = {}
        async for rid, result in answers:
            _raise_if_failed(result)
            results[rid] = result
    finally:
        for rid in ids:
            app[WAITERS].forget(rid)
    model = app[SETTINGS].spec.prefill.model_name
    choices = [choice(i, req, results[req.id], c.stop) for i, req in enumerate(reqs)]
    _observe(app, received, choices)
    return web.json_response(
        {
            **_head(completion_id, reqs[0], model),
            "choices": choices,
            "usage": usage([results[r.id] for r in reqs]),
            "kv_transfer_params": kv_params(results[reqs[0].id]),
        }
    )


def _completion_id(request: web.Request) -> str:
    given = request.headers.get("X-Request-Id")
    if given is None:
        return f"cmpl-{secrets.token_hex(12)}"
    if not REQUEST_ID.fullmatch(given):
        raise BadRequest("the X-Request-Id header must be 1-128 of A-Z a-z 0-9 . _ : -", param="X-Request-Id")
    # Unique inside the service even if two clients send the same id: the stored records never mix.
    return f"cmpl-{given}-{secrets.token_hex(4)}"


async def _as_answered(
    waiters: dict[str, asyncio.Future[PrefillResult]], timeout_s: float
) -> AsyncIterator[tuple[str, PrefillResult]]:
    """(request id, answer) in the order the answers land; 504 if some do not within `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    pending = {fut: rid for rid, fut in waiters.items()}
    while pending:
        done, _ = await asyncio.wait(
            pending, timeout=max(0.0, deadline - time.monotonic()), return_when="FIRST_COMPLETED"
        )
        if not done:
            first = next(iter(pending.values()))
            raise BadRequest(
                f"no result within {timeout_s:.0f}s; the request is still queued: GET /v1/prefill/{first}",
                status=504,
                type_="timeout_error",
            )
        for fut in done:
            yield pending.pop(fut), fut.result()


def _raise_if_failed(r: PrefillResult) -> None:
    if not r.ok:
        status = FAILURE_STATUS[r.reason] if r.reason is not None else 500
        retry = FAILED_RETRY_AFTER_S if status == 503 else None
        raise BadRequest(f"the prefill failed: {r.error}", status=status, type_="server_error", retry_after_s=retry)


def _head(completion_id: str, req: PrefillRequest, model: str) -> dict[str, Any]:
    return {"id": completion_id, "object": "text_completion", "created": int(req.submitted), "model": model}


def choice(index: int, req: PrefillRequest, r: PrefillResult, stop: tuple[str, ...]) -> dict[str, Any]:
    """One prompt's choice. A stop sequence in the token's text ends it there (finish_reason "stop",
    `stop_reason` the sequence, as vLLM reports it); otherwise the one token is the length limit."""
    text, finish, stop_reason = r.text, "length", None
    for s in stop:
        at = text.find(s)
        if at >= 0:
            text, finish, stop_reason = text[:at], "stop", s
            break
    logprobs = None
    if req.logprobs:
        logprobs = {
            "tokens": [r.text],
            "token_logprobs": [r.logprob],
            "top_logprobs": [{decode([t]): lp for t, lp in r.top}],
            "text_offset": [0],
        }
    return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish, "stop_reason": stop_reason}


def usage(results: list[PrefillResult]) -> dict[str, int]:
    prompt = sum(r.prompt_tokens for r in results)
    return {"prompt_tokens": prompt, "completion_tokens": len(results), "total_tokens": prompt + len(results)}


def _observe(app: web.Application, received: float, choices: list[dict[str, Any]]) -> None:
    m = app[METRICS]
    m.e2e_latency.labels(m.model_name).observe(time.perf_counter() - received)
    for ch in choices:
        m.success.labels(ch["finish_reason"], m.model_name).inc()


async def _stream(
    request: web.Request,
    received: float,
    c: Completion,
    completion_id: str,
    reqs: list[PrefillRequest],
    answers: AsyncIterator[tuple[str, PrefillResult]],
) -> web.StreamResponse:
    model = request.app[SETTINGS].spec.prefill.model_name
    index = {req.id: i for i, req in enumerate(reqs)}
    by_id = {req.id: req for req in reqs}
    head = _head(completion_id, reqs[0], model)
    first_id, first = await anext(answers)  # before any byte is sent: a failure keeps its status
    _raise_if_failed(first)
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    await resp.prepare(request)
    done: list[PrefillResult] = []

    async def send(event: dict[str, Any]) -> None:
        await resp.write(f"data: {json.dumps(event)}\n\n".encode())

    rid, result = first_id, first
    sent: list[dict[str, Any]] = []
    try:
        while True:
            if result.ok:
                done.append(result)
                sent.append(choice(index[rid], by_id[rid], result, c.stop))
                chunk = {**head, "choices": [sent[-1]]}
                await send({**chunk, "usage": None} if c.include_usage else chunk)
            else:
                status = FAILURE_STATUS[result.reason] if result.reason is not None else 500
                await send({"error": {"message": f"the prefill failed: {result.error}", "code": status}})
            nxt = await anext(answers, None)
            if nxt is None:
                break
            rid, result = nxt
    except BadRequest as exc:  # a timeout after the stream began: say so in the stream
        await send({"error": {"message": exc.message, "type": exc.type, "code": exc.status}})
    if c.include_usage:
        await send({**head, "choices": [], "usage": usage(done)})
    await resp.write(b"data: [DONE]\n\n")
    await resp.write_eof()
    _observe(request.app, received, sent)
    return resp
