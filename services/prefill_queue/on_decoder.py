"""A prompt computed by the decoder itself: the front door's side of `shared.policies.prompt_placement`.

A prompt comes here when the dispatcher moved it (its answer has status MOVED: the bubbles could
not compute it by its TTFT objective) or when `prefill.placement` is `decoder`. If the decoder can
compute it by its objective (`DecoderLoad`, this front door's view of what it has sent the decoder
and how fast the decoder answered), the whole completion is asked of the decoder with the prompt
and no KV cache: vLLM without ``kv_transfer_params``, or the built-in decoder service with the
prompt's tokens (`DecodeRequest.prompt`). It computes the prompt and streams every token. The first
token is the prompt's answer, as a bubble's would be (`PrefillResult`, placement DECODER); the rest
of the stream is kept for the completion's continuation (`rest`), so the prompt is computed once.
If the decoder cannot meet the objective either, the answer is a refusal (OVERLOADED: a 429 with
Retry-After).

Tested by: tests/integration/test_builtin_placement.py.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncGenerator, AsyncIterator

from aiohttp import web

from services.prefill_queue.api import served_model
from services.prefill_queue.builtin_decode import continue_completion
from services.prefill_queue.state import DECODER_LOAD, METRICS, SETTINGS, VLLM
from services.prefill_queue.validation import Completion
from services.prefill_queue.vllm_decode import deadline_s
from shared.model.tokenizer import Tokenizer
from shared.policies.prompt_placement import DecoderLoad
from shared.wire import DecodeChunk, PrefillRequest, PrefillResult
from shared.wire.status import FailureReason, PromptPlacement, RequestStatus

#: A decoder-computed completion's first chunk and the rest of its stream, by request id, until its
#: continuation takes them (`rest`).
REST: web.AppKey[dict[str, tuple[DecodeChunk, AsyncGenerator[DecodeChunk, None]]]] = web.AppKey("decoder_rest")


def setup(app: web.Application) -> None:
    app[DECODER_LOAD] = DecoderLoad()
    app[REST] = {}


async def compute(
    app: web.Application, req: PrefillRequest, c: Completion, tokenizer: Tokenizer, moved_why: str = ""
) -> PrefillResult:
    """`req`'s first token computed by the decoder (the rest kept in `REST` when more are asked), or
    its refusal (the decoder cannot meet its objective either) or failure."""
    sent = time.time()
    tokens = len(req.tokens)
    load = app[DECODER_LOAD]
    verdict = load.verdict(req.objective - sent if req.objective is not None else None, sent)
    if verdict.where is None:
        why = f"{moved_why}; {verdict.why}" if moved_why else verdict.why
        return _failed(req, FailureReason.OVERLOADED, why, sent)
    load.sent()
    stream = _whole_completion(app, req, c)
    try:
        first = await anext(stream)
    except BaseException:
        load.answered(None, time.time())
        await stream.aclose()
        raise
    now = time.time()
    if first.status is RequestStatus.FAILED or not first.tokens:
        load.answered(None, now)
        await stream.aclose()
        reason = first.reason or FailureReason.KV_MISSING
        return _failed(req, reason, first.error or "the decoder sent no token", sent)
    load.answered(now - sent, now)
    if c.max_tokens > 1:
        app[REST][req.id] = (first, stream)
    else:
        await stream.aclose()
    ttft_s = now - req.submitted
    app[METRICS].placed_prompt(PromptPlacement.DECODER, tokens, ttft_s)
    return PrefillResult(
        id=req.id,
        status=RequestStatus.DONE,
        token=first.tokens[0],
        text=tokenizer.decode([first.tokens[0]]),
        prompt_tokens=tokens,
        worker="decoder",
        queue_ms=(sent - req.submitted) * 1000,
        prefill_ms=(now - sent) * 1000,
        finished=now,
        placement=PromptPlacement.DECODER,
    )


def _whole_completion(app: web.Application, req: PrefillRequest, c: Completion) -> AsyncGenerator[DecodeChunk, None]:
    """`req`'s whole completion, its prompt computed by the decoder `decode.engine` names."""
    spec = app[SETTINGS].spec
    vllm = app[VLLM]
    if vllm is not None:
        timeout_s = deadline_s(req, spec.prefill.request_timeout_s)
        return vllm.continue_completion(req, None, {}, c.max_tokens, c.stop, c.ignore_eos, timeout_s)
    eos = () if c.ignore_eos else served_model(spec.prefill)[0].eos_token_ids
    return continue_completion(app, req, c.max_tokens, c.stop, eos, prompt=req.tokens)


def rest(app: web.Application, request_id: str) -> AsyncIterator[DecodeChunk] | None:
    """The chunks after a decoder-computed completion's first token (None: not computed there)."""
    kept = app[REST].pop(request_id, None)
    return _after_first(*kept) if kept is not None else None


async def _after_first(first: DecodeChunk, stream: AsyncGenerator[DecodeChunk, None]) -> AsyncIterator[DecodeChunk]:
    """The completion after its first token: what came with it, then the rest of vLLM's stream."""
    try:
        if len(first.tokens) > 1 or first.done:
            yield DecodeChunk(
                id=first.id,
                index=1,
                tokens=first.tokens[1:],
                done=first.done,
                finish_reason=first.finish_reason,
                stop_reason=first.stop_reason,
            )
            if first.done:
                return
        async for chunk in stream:
            yield chunk
    finally:
        await stream.aclose()


def forget(app: web.Application, request_id: str) -> None:
    """A completion answered or abandoned before its continuation took its stream: close it (vLLM
    ends the request when its stream is closed)."""
    kept = app[REST].pop(request_id, None)
    if kept is not None:
        _closing.add(task := asyncio.ensure_future(kept[1].aclose()))
        task.add_done_callback(_closing.discard)


_closing: set[asyncio.Future[None]] = set()  # the streams being closed (a reference keeps each task)


def _failed(req: PrefillRequest, reason: FailureReason, why: str, sent: float) -> PrefillResult:
    now = time.time()
    return PrefillResult(
        id=req.id,
        status=RequestStatus.FAILED,
        reason=reason,
        error=why,
        prompt_tokens=len(req.tokens),
        queue_ms=(sent - req.submitted) * 1000,
        finished=now,
        placement=PromptPlacement.DECODER,
    )
