"""The built-in decoder service's side of a completion, as the front door sees it.

`continue_completion` publishes a `DecodeRequest` and yields its `DecodeChunk`s in order as they
land on this instance's results stream (`Waiters.expect_chunks`), each holding only tokens not
yielded before: a decoder that died and was replaced starts the completion over (from the KV cache,
or computing the prompt again), and what the front door already has is dropped by `index` (greedy
and seeded completions repeat the same tokens; the text is made here, from the tokens). A decode
that does not end by the request's deadline ends with a 504 saying how far it got.

With `prompt` the decoder computes the prompt itself (`shared.policies.prompt_placement` placed it
there) and the chunks start at the first token (index 0); else they continue a prefill from the
first token's KV cache, at index 1.

Tested by: tests/integration/test_builtin_placement.py, tests/e2e/test_openai_client.py.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncGenerator

import msgspec
from aiohttp import web

from services.prefill_queue.answers import DEADLINE_GRACE_S
from services.prefill_queue.state import BUS, SETTINGS, STOPPING, WAITERS, instance_results_stream
from services.prefill_queue.validation import BadRequest
from shared.wire import DecodeChunk, DecodeRequest, PrefillRequest, keys

#: A decode wait wakes at least this often to notice the front door stopping.
POLL_S = 0.5


async def continue_completion(
    app: web.Application,
    req: PrefillRequest,
    max_tokens: int,
    stop: tuple[str, ...],
    eos: tuple[int, ...] = (),
    kv_holder: str = "",
    prompt: tuple[int, ...] = (),
) -> AsyncGenerator[DecodeChunk, None]:
    """The chunks of `req`'s completion after its first token, ending with the one marked done.
    `kv_holder`: the prefill answer's, where its KV cache is (empty: in Redis). With `prompt`: the
    decoder computes it, and the chunks start with the first token."""
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
        kv_holder=kv_holder,
        prompt=prompt,
    )
    await app[BUS].publish(keys.decode_requests_stream(app[SETTINGS].run), decode)
    expected = 0 if prompt else 1  # index of the next token: the prefill's token is 0
    # the decoder fails a completion past its deadline; waiting DEADLINE_GRACE_S more is the safety net
    deadline = DEADLINE_GRACE_S + (
        req.deadline if req.deadline is not None else time.time() + app[SETTINGS].spec.prefill.request_timeout_s
    )
    stopping = app[STOPPING]
    while True:
        grace_left = stopping.deadline(float("inf")) - time.monotonic()
        try:  # woken at least every POLL_S, to notice the front door stopping
            async with asyncio.timeout(max(0.0, min(deadline - time.time(), grace_left, POLL_S))):
                chunk = await queue.get()
        except TimeoutError:
            if stopping.event.is_set() and time.monotonic() >= stopping.deadline(float("inf")):
                raise BadRequest(
                    f"this front door is stopping; the completion was not finished ({expected} tokens received)",
                    status=503,
                    type_="service_unavailable",
                    retry_after_s=1,
                ) from None
            if time.time() < deadline:
                continue
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
