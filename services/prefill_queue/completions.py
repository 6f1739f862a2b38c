"""POST /v1/completions: the OpenAI completions API as the official client and `vllm bench serve` speak it.

Each prompt of the request is queued on its own and prefilled in the bubbles; its answer is the
first token. With ``max_tokens`` > 1 (the decoder on: `decode.enabled`) the decoder continues each
prompt from its KV cache (`decoding.continue_completion`) and the choice is the whole completion.
Without streaming the answer is one JSON body with a choice per prompt. With ``stream: true`` it is
server-sent events: a chunk per prompt as its first token lands (its text, logprobs and, if that
ends it, its finish reason), then chunks of further text as the decoder produces them, a usage chunk
when ``stream_options.include_usage`` is set, then ``data: [DONE]``. The stream starts only once the
first answer is in, so a request that fails before anything was sent still gets its HTTP error
status; a failure after that is an ``error`` event.
"""

from __future__ import annotations

import asyncio
import json
import re
import secrets
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from services.prefill_queue.api import (
    FAILED_RETRY_AFTER_S,
    FAILURE_STATUS,
    enqueue,
    kv_params,
    limits,
    refuse_if_not_serving,
    served_model,
)
from services.prefill_queue.decoding import continue_completion
from services.prefill_queue.state import METRICS, SETTINGS, WAITERS
from services.prefill_queue.validation import BadRequest, Completion, parse_completion
from shared.logs import get_logger
from shared.model.tokenizer import BYTES, Tokenizer, find_stop, token_text
from shared.status import RequestStatus
from shared.wire import PrefillRequest, PrefillResult

log = get_logger(__name__)

#: An X-Request-Id a client sends becomes the completion's id (as vLLM does): printable, bounded.
REQUEST_ID = re.compile(r"[A-Za-z0-9._:\-]{1,128}")


async def completions(request: web.Request) -> web.StreamResponse:
    app = request.app
    received = time.perf_counter()
    try:
        body = await request.json()
    except (ValueError, UnicodeDecodeError) as exc:
        raise BadRequest(f"the request body is not valid JSON: {exc}") from None
    lim = limits(app)
    c = parse_completion(body, lim)
    await refuse_if_not_serving(app)  # once for all the prompts: none is queued if the answer is no
    completion_id = _completion_id(request)
    ids = [completion_id] if len(c.prompts) == 1 else [f"{completion_id}-{i}" for i in range(len(c.prompts))]
    waiters = {rid: app[WAITERS].expect(rid) for rid in ids}
    try:
        reqs = [await enqueue(request, parsed, rid) for parsed, rid in zip(c.prompts, ids, strict=True)]
        answers = _as_answered(waiters, c.prompts[0].timeout_s)
        if c.max_tokens > 1:
            return await _whole(request, received, c, completion_id, reqs, answers, lim.tokenizer)
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
    choices = [choice(i, req, results[req.id], c.stop, tokenizer=lim.tokenizer) for i, req in enumerate(reqs)]
    _observe(app, received, choices)
    return web.json_response(
        {
            **_head(completion_id, reqs[0], model),
            "choices": choices,
            "usage": usage([results[r.id] for r in reqs]),
            "kv_transfer_params": kv_params(results[reqs[0].id]),
        }
    )


# --- whole completions (the decoder) --------------------------------------------------------


@dataclass
class _Text:
    """One choice's text as its tokens come: what was sent, and how it ended."""

    tokenizer: Tokenizer
    stop: tuple[str, ...]
    tokens: list[int] = field(default_factory=list)
    sent: str = ""
    finish: str | None = None
    stop_reason: str | None = None

    def add(self, tokens: tuple[int, ...] | list[int], *, done: bool = False, finish: str | None = None) -> str:
        """Take more tokens; return the text not sent yet (held back while it ends in an unfinished
        character). A stop sequence ends the choice there; else `done` ends it with `finish`
        (the decoder's reason: "stop" for an end-of-sequence token) or "length"."""
        self.tokens += tokens
        text = self.tokenizer.decode(self.tokens)
        hit = find_stop(text, self.stop)
        if hit is not None:
            text, self.finish, self.stop_reason, done = text[: hit[0]], "stop", hit[1], True
        if not done and text.endswith("\ufffd"):
            text = text.rstrip("\ufffd")
        new = text[len(self.sent) :] if text.startswith(self.sent) else ""
        self.sent += new
        if done and self.finish is None:
            self.finish = finish or "length"
        return new


async def _whole(
    request: web.Request,
    received: float,
    c: Completion,
    completion_id: str,
    reqs: list[PrefillRequest],
    answers: AsyncIterator[tuple[str, PrefillResult]],
    tokenizer: Tokenizer,
) -> web.StreamResponse:
    """Prefill answers, then each prompt's decoding, as one JSON body or as server-sent events."""
    app = request.app
    index = {req.id: i for i, req in enumerate(reqs)}
    by_id = {req.id: req for req in reqs}
    texts = {req.id: _Text(tokenizer, c.stop) for req in reqs}
    eos = () if c.ignore_eos else served_model(app[SETTINGS].spec.prefill)[0].eos_token_ids
    events: asyncio.Queue[tuple[str, str, bool] | BadRequest] = asyncio.Queue()  # (id, new text, done)

    async def decode(rid: str, first: PrefillResult) -> None:
        try:
            await decode_one(rid, first)
        except Exception as exc:  # never a silent hang: the client gets the failure
            log.exception("decoding a completion failed", id=rid)
            await events.put(BadRequest(f"decoding failed: {exc!r}", status=500, type_="server_error"))

    async def decode_one(rid: str, first: PrefillResult) -> None:
        t = texts[rid]
        new = t.add([first.token], done=c.max_tokens == 1)
        if first.token in eos and t.finish is None:
            t.finish = "stop"  # the model ended it at once (vLLM's finish reason for EOS)
        await events.put((rid, new, t.finish is not None))
        if t.finish is not None:
            return  # the first token already ended it (a stop sequence)
        try:
            async for chunk in continue_completion(app, by_id[rid], c.max_tokens, c.stop, eos):
                if chunk.status is not RequestStatus.DONE:
                    status = FAILURE_STATUS[chunk.reason] if chunk.reason is not None else 500
                    await events.put(
                        BadRequest(f"the decode failed: {chunk.error}", status=status, type_="server_error")
                    )
                    return
                new = t.add(chunk.tokens, done=chunk.done, finish=chunk.finish_reason)
                await events.put((rid, new, t.finish is not None))
                if t.finish is not None:
                    return
        except BadRequest as exc:
            await events.put(exc)

    tasks: list[asyncio.Task[None]] = []
    try:
        first_id, first = await anext(answers)  # before any byte: a failure keeps its HTTP status
        _raise_if_failed(first)
        results = {first_id: first}
        tasks.append(asyncio.create_task(decode(first_id, first)))

        async def rest() -> None:
            async for rid, result in answers:
                results[rid] = result
                if result.ok:
                    tasks.append(asyncio.create_task(decode(rid, result)))
                else:
                    status = FAILURE_STATUS[result.reason] if result.reason is not None else 500
                    await events.put(BadRequest(f"the prefill failed: {result.error}", status=status))

        collector = asyncio.create_task(rest())
        tasks.append(collector)
        if c.stream:
            return await _stream_whole(request, received, c, completion_id, reqs, texts, events, results)
        ended = 0
        while ended < len(reqs):
            ev = await events.get()
            if isinstance(ev, BadRequest):
                raise ev
            ended += ev[2]
    finally:
        for t in tasks:
            t.cancel()
        for req in reqs:
            app[WAITERS].forget(req.id)
    model = app[SETTINGS].spec.prefill.model_name
    choices = [_whole_choice(index[r.id], texts[r.id]) for r in reqs]
    _observe(app, received, choices)
    return web.json_response(
        {
            **_head(completion_id, reqs[0], model),
            "choices": choices,
            "usage": _whole_usage(reqs, results, texts),
            "kv_transfer_params": kv_params(results[reqs[0].id]),
        }
    )


def _whole_choice(i: int, t: _Text, text: str | None = None) -> dict[str, Any]:
    return {
        "index": i,
        "text": t.sent if text is None else text,
        "logprobs": None,
        "finish_reason": t.finish,
        "stop_reason": t.stop_reason,
    }


def _whole_usage(
    reqs: list[PrefillRequest], results: dict[str, PrefillResult], texts: dict[str, _Text]
) -> dict[str, int]:
    prompt = sum(r.prompt_tokens for r in results.values())
    completion = sum(len(texts[r.id].tokens) for r in reqs)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


async def _stream_whole(
    request: web.Request,
    received: float,
    c: Completion,
    completion_id: str,
    reqs: list[PrefillRequest],
    texts: dict[str, _Text],
    events: asyncio.Queue[tuple[str, str, bool] | BadRequest],
    results: dict[str, PrefillResult],
) -> web.StreamResponse:
    """The events of `_whole` as server-sent events: a chunk per piece of new text."""
    head = _head(completion_id, reqs[0], request.app[SETTINGS].spec.prefill.model_name)
    index = {req.id: i for i, req in enumerate(reqs)}
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    await resp.prepare(request)

    async def send(event: dict[str, Any]) -> None:
        await resp.write(f"data: {json.dumps(event)}\n\n".encode())

    ended = 0
    while ended < len(reqs):
        ev = await events.get()
        if isinstance(ev, BadRequest):
            await send({"error": {"message": ev.message, "type": ev.type, "code": ev.status}})
            ended += 1
            continue
        rid, new, done = ev
        if not new and not done:
            continue
        t = texts[rid]
        chunk = {
            **head,
            "choices": [{**_whole_choice(index[rid], t, new), "finish_reason": t.finish if done else None}],
        }
        await send({**chunk, "usage": None} if c.include_usage else chunk)
        ended += done
    if c.include_usage:
        await send({**head, "choices": [], "usage": _whole_usage(reqs, results, texts)})
    await resp.write(b"data: [DONE]\n\n")
    await resp.write_eof()
    _observe(request.app, received, [_whole_choice(index[r.id], texts[r.id]) for r in reqs])
    return resp


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


def choice(
    index: int, req: PrefillRequest, r: PrefillResult, stop: tuple[str, ...], *, tokenizer: Tokenizer = BYTES
) -> dict[str, Any]:
    """One prompt's choice. A stop sequence in the token's text ends it there (finish_reason "stop",
    `stop_reason` the sequence, as vLLM reports it); otherwise the one token is the length limit.
    The top logprobs are keyed by each token's text in the served model's `tokenizer`."""
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
            "top_logprobs": [{token_text(tokenizer, t): lp for t, lp in r.top}],
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
    tokenizer = limits(request.app).tokenizer
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
                sent.append(choice(index[rid], by_id[rid], result, c.stop, tokenizer=tokenizer))
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
