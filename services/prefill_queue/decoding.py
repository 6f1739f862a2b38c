"""Whole completions: after a prompt's prefill (done in the bubbles), the decoder generates the rest.

`continue_completion` publishes a `DecodeRequest` for a prefilled prompt and yields its
`DecodeChunk`s in order as they land on this instance's results stream (`Waiters.expect_chunks`),
each holding only tokens not yielded before: a decoder that died and was replaced starts the
completion over from the KV cache, and what the front door already has is dropped by `index`
(greedy and seeded completions repeat the same tokens; the text is made here, from the tokens).
A decode that does not end by the request's deadline ends with a 504 saying how far it got.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import msgspec
from aiohttp import web

from services.prefill_queue.state import BUS, SETTINGS, WAITERS, instance_results_stream
from services.prefill_queue.validation import BadRequest
from shared import keys
from shared.wire import DecodeChunk, DecodeRequest, PrefillRequest


async def continue_completion(
    app: web.Application, req: PrefillRequest, max_tokens: int, stop: tuple[str, ...], eos: tuple[int, ...] = ()
) -> AsyncIterator[DecodeChunk]:
    """The chunks of `req`'s completion after its first token, ending with the one marked done."""
    queue = app[WAITERS].expect_chunks(req.id)
    model = app[SETTINGS].spec.prefill.model_name
    decode = DecodeRequest(
        id=req.id,
        model=model,
        max_tokens=max_tokens,
        temperature=req.temperature,
        seed=req.seed,
        stop=stop,
        eos=eos,
        submitted=req.submitted,
        deadline=req.deadline,
        reply_to=instance_results_stream(app),
    )
    await app[BUS].publish(keys.DECODE_REQUESTS_STREAM, decode)
    expected = 1  # index of the next token: the prefill's token is 0
    deadline = req.deadline if req.deadline is not None else time.time() + app[SETTINGS].spec.prefill.request_timeout_s
    while True:
        try:
            async with asyncio.timeout(max(0.0, deadline - time.time())):
                chunk = await queue.get()
        except TimeoutError:
            raise BadRequest(
                f"the completion was not finished by its deadline ({expected} tokens received); is a decoder "
                "running? (bubbletea up --decode, or compose's decode profile)",
                status=504,
                type_="timeout_error",
            ) from None
        if chunk.index > expected:
            continue  # a gap cannot happen with one decoder at a time; never emit one
        new = chunk.tokens[expected - chunk.index :]
        if not new and not chunk.done:
            continue  # all already had
        expected += len(new)
        yield msgspec.structs.replace(chunk, index=expected - len(new), tokens=new)
        if chunk.done:
            return
