"""POST /v1/completions: the OpenAI completions API as the official client and `vllm bench serve` speak it.

Each prompt of the request is queued on its own and prefilled in the bubbles; its answer is the
first token. With ``max_tokens`` > 1 (the decoder on: `decode.enabled`) the decoder continues each
prompt from its KV cache (`builtin_decode.continue_completion`, or vLLM) and the choice is the whole completion.
Without streaming the answer is one JSON body with a choice per prompt. With ``stream: true`` it is
server-sent events: a chunk per prompt as its first token lands (its text, logprobs and, if that
ends it, its finish reason), then chunks of further text as the decoder produces them, a usage chunk
when ``stream_options.include_usage`` is set, then ``data: [DONE]``. The stream starts only once the
first answer is in, so a request that fails before anything was sent still gets its HTTP error
status; a failure after that is an ``error`` event.

Tested by: tests/integration/test_prefill_api.py, tests/integration/test_loadgen_http.py,
tests/e2e/test_openai_client.py.
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

from services.prefill_queue import on_decoder
from services.prefill_queue.answers import (
    as_answered,
    back_s,
    choice,
    head,
    hops_s,
    hops_seen,
    observe,
    opening,
    raise_if_failed,
    server_timing,
    shaped,
    usage,
)
from services.prefill_queue.api import (
    FAILURE_STATUS,
    enqueue,
    kv_params,
    limits,
    new_request,
    not_serving,
    read_json,
    refuse_if_not_serving,
)
from services.prefill_queue.decoding import whole
from services.prefill_queue.state import GATE, SETTINGS, STOPPING, VLLM, WAITERS
from services.prefill_queue.validation import BadRequest, Completion, parse_completion
from shared.policies.prompt_placement import Mode, mode_of
from shared.wire import PrefillRequest, PrefillResult

__all__ = ["choice", "completions", "usage"]  # choice and usage: the shapes, re-exported for callers

#: An X-Request-Id a client sends becomes the completion's id (as vLLM does): printable, bounded.
REQUEST_ID = re.compile(r"[A-Za-z0-9._:\-]{1,128}")


async def completions(request: web.Request) -> web.StreamResponse:
    received = time.perf_counter()
    c = parse_completion(await read_json(request), limits(request.app))
    return await answer(request, received, c, "cmpl")


async def answer(request: web.Request, received: float, c: Completion, prefix: str) -> web.StreamResponse:
    """Queue a validated request's prompts and answer it (the chat endpoint's way too; `prefix`
    starts the answer's id)."""
    app = request.app
    lim = limits(app)
    mode = placement_mode(app, c)
    if mode is Mode.AUTO and await not_serving(app) is not None:
        mode = Mode.DECODER  # the bubbles cannot serve now (training stopped, a worker lost): the decoder can
    elif mode is Mode.BUBBLES:
        await refuse_if_not_serving(app)  # once for all the prompts: none is queued if the answer is no
    completion_id = _completion_id(request, prefix)
    ids = [completion_id] if len(c.prompts) == 1 else [f"{completion_id}-{i}" for i in range(len(c.prompts))]
    waiters = {rid: app[WAITERS].expect(rid) for rid in ids}
    try:
        if mode is Mode.DECODER:  # the bubbles are not used: the decoder computes every prompt
            pairs = zip(c.prompts, ids, strict=True)
            reqs = [new_request(app, p, rid, may_move=True, received=received) for p, rid in pairs]
            for req in reqs:
                waiters[req.id] = asyncio.ensure_future(on_decoder.compute(app, req, c, lim.tokenizer))
        else:
            may_move = mode is Mode.AUTO
            reqs = [
                await enqueue(request, parsed, rid, may_move=may_move, received=received)
                for parsed, rid in zip(c.prompts, ids, strict=True)
            ]
        queued = time.perf_counter()  # the front door's first hop ends here
        by_id = {req.id: req for req in reqs}

        async def moved(rid: str, r: PrefillResult) -> PrefillResult:
            return await on_decoder.compute(app, by_id[rid], c, lim.tokenizer, r.error)

        deadline = reqs[0].deadline if reqs[0].deadline is not None else time.time() + c.prompts[0].timeout_s
        answers = as_answered(waiters, deadline, app[STOPPING], moved if mode is not Mode.BUBBLES else None)
        if c.max_tokens > 1:
            return await whole(request, received, c, completion_id, reqs, answers, lim.tokenizer)
        if c.stream:
            return await _stream(request, received, queued, c, completion_id, reqs, answers)
        results: dict[str, PrefillResult] = {}
        async for rid, result in answers:
            raise_if_failed(result)
            results[rid] = result
        landed, back = time.perf_counter(), back_s(results[rid])  # the last to land
    finally:
        for rid in ids:
            app[WAITERS].forget(rid)
            on_decoder.forget(app, rid)  # a stream its continuation did not take (a failure, a disconnect)
    model = app[SETTINGS].spec.prefill.model_name
    choices = [
        shaped(c, choice(i, req, results[req.id], c.stop, tokenizer=lim.tokenizer)) for i, req in enumerate(reqs)
    ]
    observe(app, received, choices)
    hops_seen(app, hops_s(received, queued, landed, back))  # its body is written next
    return web.json_response(
        {
            **head(completion_id, reqs[0], model, c.object_name(chunk=False)),
            "choices": choices,
            "usage": usage([results[r.id] for r in reqs]),
            "kv_transfer_params": kv_params(results[reqs[0].id]),
        },
        headers=server_timing(received),
    )


def placement_mode(app: web.Application, c: Completion) -> Mode:
    """Where this request's prompts may be computed (`prefill.placement`): the bubbles only unless
    a decoder that computes prompts is here (vLLM, or a live built-in decoder service) and no prompt
    asks for the top logprobs, which only the bubbles return in our shape."""
    if any(p.logprobs for p in c.prompts):
        return Mode.BUBBLES
    return default_mode(app)


def default_mode(app: web.Application) -> Mode:
    """Where a plain request's prompt may be computed now: `prefill.placement` (or its default)
    where a decoder that computes prompts is here (vLLM, or a live built-in decoder), else the
    bubbles only."""
    spec = app[SETTINGS].spec
    decoder_here = app[VLLM] is not None or (spec.decode.enabled and app[GATE].decoder_live)
    return mode_of(spec.prefill.placement, spec.decode.enabled) if decoder_here else Mode.BUBBLES


def _completion_id(request: web.Request, prefix: str) -> str:
    given = request.headers.get("X-Request-Id")
    if given is None:
        return f"{prefix}-{secrets.token_hex(12)}"
    if not REQUEST_ID.fullmatch(given):
        raise BadRequest("the X-Request-Id header must be 1-128 of A-Z a-z 0-9 . _ : -", param="X-Request-Id")
    # Unique inside the service even if two clients send the same id: the stored records never mix.
    return f"{prefix}-{given}-{secrets.token_hex(4)}"


async def _stream(
    request: web.Request,
    received: float,
    queued: float,
    c: Completion,
    completion_id: str,
    reqs: list[PrefillRequest],
    answers: AsyncIterator[tuple[str, PrefillResult]],
) -> web.StreamResponse:
    """The answers as server-sent events, each as it lands. The front door's hops (`queued` less
    `received`, and from the first answer landing to its event written) are recorded."""
    model = request.app[SETTINGS].spec.prefill.model_name
    tokenizer = limits(request.app).tokenizer
    index = {req.id: i for i, req in enumerate(reqs)}
    by_id = {req.id: req for req in reqs}
    top = head(completion_id, reqs[0], model, c.object_name(chunk=True))
    first_id, first = await anext(answers)  # before any byte is sent: a failure keeps its status
    landed, back = time.perf_counter(), back_s(first)
    raise_if_failed(first)
    headers = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache", **server_timing(received)}
    resp = web.StreamResponse(headers=headers)
    await resp.prepare(request)
    done: list[PrefillResult] = []

    async def send(event: dict[str, Any]) -> None:
        await resp.write(f"data: {json.dumps(event)}\n\n".encode())

    if (role := opening(c, top)) is not None:
        await send(role)

    rid, result = first_id, first
    sent: list[dict[str, Any]] = []
    try:
        while True:
            if result.ok:
                done.append(result)
                sent.append(shaped(c, choice(index[rid], by_id[rid], result, c.stop, tokenizer=tokenizer), delta=True))
                chunk = {**top, "choices": [sent[-1]]}
                await send({**chunk, "usage": None} if c.include_usage else chunk)
                if len(sent) == 1:
                    hops_seen(request.app, hops_s(received, queued, landed, back))
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
        await send({**top, "choices": [], "usage": usage(done)})
    await resp.write(b"data: [DONE]\n\n")
    await resp.write_eof()
    observe(request.app, received, sent)
    return resp
