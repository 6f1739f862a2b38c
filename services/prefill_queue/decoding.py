"""Whole completions: after a prompt's prefill (done in the bubbles), the decoder generates the rest.

The rest comes from the engine `decode.engine` names: the decoder service
(`builtin_decode.continue_completion`) or vLLM (`vllm_decode`); a prompt the decoder computed itself
has its stream already (`on_decoder.rest`).

`whole` answers a /v1/completions request with ``max_tokens`` > 1 from these: its prefill answers,
then each prompt's decoding, as one JSON body or as server-sent events (a chunk per piece of new
text); the text is made from all of a choice's tokens with the model's tokenizer (`_Text`), cut at
a stop string, held back while it ends in an unfinished character.

Tested by: tests/e2e/test_openai_client.py, tests/integration/test_builtin_placement.py,
tests/e2e/test_openai_chat.py.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from services.prefill_queue import on_decoder
from services.prefill_queue.answers import (
    head,
    observe,
    opening,
    prompt_tokens_details,
    raise_if_failed,
    shaped,
)
from services.prefill_queue.api import FAILURE_STATUS, kv_params, served_model
from services.prefill_queue.builtin_decode import continue_completion
from services.prefill_queue.state import SETTINGS, VLLM, WAITERS
from services.prefill_queue.validation import BadRequest, Completion
from services.prefill_queue.vllm_decode import deadline_s
from shared.model.tokenizer import Tokenizer, find_stop
from shared.runtime.logs import get_logger
from shared.wire import DecodeChunk, PrefillRequest, PrefillResult
from shared.wire.status import RequestStatus

log = get_logger(__name__)


def _continuation(
    app: web.Application, req: PrefillRequest, first: PrefillResult, c: Completion
) -> AsyncIterator[DecodeChunk]:
    """The chunks after the first token, from the engine `decode.engine` names."""
    spec = app[SETTINGS].spec
    vllm = app[VLLM]
    if (computed := on_decoder.rest(app, req.id)) is not None:  # its prompt computed by vLLM itself
        return computed
    if vllm is not None:
        timeout_s = deadline_s(req, spec.prefill.request_timeout_s)
        return vllm.continue_completion(
            req, first.token, kv_params(first), c.max_tokens, c.stop, c.ignore_eos, timeout_s
        )
    eos = () if c.ignore_eos else served_model(spec.prefill)[0].eos_token_ids
    return continue_completion(app, req, c.max_tokens, c.stop, eos, first.kv_holder)


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


async def whole(
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
            async for chunk in _continuation(app, by_id[rid], first, c):
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
        raise_if_failed(first)
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
    choices = [shaped(c, _whole_choice(index[r.id], texts[r.id])) for r in reqs]
    if c.return_token_ids:  # vLLM's field: the completion's token ids beside its text
        for ch, r in zip(choices, reqs, strict=True):
            ch["token_ids"] = list(texts[r.id].tokens)
    observe(app, received, choices)
    return web.json_response(
        {
            **head(completion_id, reqs[0], model, c.object_name(chunk=False)),
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
) -> dict[str, Any]:
    prompt = sum(r.prompt_tokens for r in results.values())
    completion = sum(len(texts[r.id].tokens) for r in reqs)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": prompt_tokens_details(results.values()),  # where they were computed
    }


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
    """The events of `whole` as server-sent events: a chunk per piece of new text."""
    top = head(completion_id, reqs[0], request.app[SETTINGS].spec.prefill.model_name, c.object_name(chunk=True))
    index = {req.id: i for i, req in enumerate(reqs)}
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    await resp.prepare(request)

    async def send(event: dict[str, Any]) -> None:
        await resp.write(f"data: {json.dumps(event)}\n\n".encode())

    if (role := opening(c, top)) is not None:
        await send(role)

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
        piece = {**_whole_choice(index[rid], t, new), "finish_reason": t.finish if done else None}
        chunk = {**top, "choices": [shaped(c, piece, delta=True)]}
        await send({**chunk, "usage": None} if c.include_usage else chunk)
        ended += done
    if c.include_usage:
        await send({**top, "choices": [], "usage": _whole_usage(reqs, results, texts)})
    await resp.write(b"data: [DONE]\n\n")
    await resp.write_eof()
    observe(request.app, received, [_whole_choice(index[r.id], texts[r.id]) for r in reqs])
    return resp
