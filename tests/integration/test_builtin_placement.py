"""Prompts placed on the built-in decoder service (`shared.policies.prompt_placement`), over real HTTP
against a real redis-server and a real decoder: it computes the prompt itself, the answer names the
placement (`usage.prompt_tokens_details.decoder_tokens`), and its tokens are a local full
generation's. A prompt is never placed on a decoder that is not alive: it goes to the bubbles."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time
from collections.abc import AsyncIterator
from typing import Any

import msgspec
import pytest
from aiohttp.test_utils import TestClient, TestServer
from redis.asyncio import Redis

from services.decoder.decoder import serve
from services.prefill_queue.app import create_app
from services.prefill_queue.state import GATE
from shared.config.settings import Settings, load_settings
from shared.control import serving, verdicts
from shared.model.generate import generate
from shared.model.prefill import PrefillModel
from shared.model.tokenizer import decode, encode
from shared.wire import FIELD, PrefillRequest, PrefillResult, keys
from shared.wire import decode as decode_msg
from shared.wire.status import RequestStatus, ServingState

PROMPT = "Computed by the decoder"
RUN = "placement"


def settings_for(redis_url: str, placement: str | None) -> Settings:
    s = load_settings(None)
    spec = msgspec.structs.replace(
        s.spec,
        decode=msgspec.structs.replace(s.spec.decode, enabled=True, chunk_ms=1.0),
        prefill=msgspec.structs.replace(s.spec.prefill, placement=placement, request_timeout_s=30.0),
    )
    return dataclasses.replace(s, redis_url=redis_url, run=RUN, spec=spec)


@pytest.fixture
async def decoder(redis_url: str) -> AsyncIterator[PrefillModel]:
    settings = settings_for(redis_url, None)
    stop = asyncio.Event()
    task = asyncio.create_task(serve(settings, stop))
    yield PrefillModel.from_spec(settings.spec.prefill)  # the same weights the decoder loads
    stop.set()
    await asyncio.wait_for(task, 30)


async def front_door(redis_url: str, placement: str | None, *, decoder_alive: bool) -> TestClient:
    client = TestClient(TestServer(create_app(settings_for(redis_url, placement))))
    await client.start_server()
    async with asyncio.timeout(30):
        while client.app[GATE].decoder_live != decoder_alive:  # noqa: ASYNC110
            await asyncio.sleep(0.05)  # the front door re-reads the decoders' heartbeats every second
    return client


def sse_text(body: str) -> str:
    events = [json.loads(line[6:]) for line in body.splitlines() if line.startswith("data: {")]
    return "".join(e["choices"][0]["text"] for e in events if e.get("choices"))


async def test_placement_decoder_has_the_built_in_decoder_compute_every_prompt(
    decoder: PrefillModel, redis_url: str, redis: Redis
) -> None:
    tokens = encode(PROMPT)
    client = await front_door(redis_url, "decoder", decoder_alive=True)
    try:
        body = {"model": "bubbletea-gpt", "prompt": PROMPT, "max_tokens": 16, "temperature": 0}
        resp = await client.post("/v1/completions", json=body)
        assert resp.status == 200, await resp.text()
        answer: dict[str, Any] = await resp.json()
        streamed = await client.post("/v1/completions", json={**body, "stream": True})
        assert streamed.status == 200, await streamed.text()
        text = sse_text(await streamed.text())
        one = await client.post("/v1/completions", json={**body, "max_tokens": 1, "temperature": 0.9, "seed": 3})
        first: dict[str, Any] = await one.json()
    finally:
        await client.close()
    want = generate(decoder, tokens, 16)
    assert answer["choices"][0]["text"] == text == decode(want)
    assert answer["usage"]["prompt_tokens_details"] == {"bubble_tokens": 0, "decoder_tokens": len(tokens)}
    assert first["choices"][0]["text"] == decode([decoder.prefill(tokens, temperature=0.9, seed=3).token])
    assert await redis.xlen(keys.prefill_requests_stream(RUN)) == 0  # the bubbles were not asked


async def test_auto_places_prompts_on_the_decoder_while_the_bubbles_cannot_serve(
    decoder: PrefillModel, redis_url: str, redis: Redis
) -> None:
    """auto is the default with decode on: training finished, the bubbles cannot serve (where
    bubbles-only answers 503), and the decoder computes the prompt."""
    verdict = verdicts.Readiness(
        instance="d1", run=RUN, state=ServingState.FINISHED, reason="training finished", retry_after_s=5, at=time.time()
    )
    await verdicts.publish_readiness(redis, verdict)
    client = await front_door(redis_url, None, decoder_alive=True)
    try:
        resp = await client.post(
            "/v1/completions", json={"model": "bubbletea-gpt", "prompt": PROMPT, "max_tokens": 4, "temperature": 0}
        )
        assert resp.status == 200, await resp.text()
        answer: dict[str, Any] = await resp.json()
    finally:
        await client.close()
    tokens = encode(PROMPT)
    assert answer["choices"][0]["text"] == decode(generate(decoder, tokens, 4))
    assert answer["usage"]["prompt_tokens_details"] == {"bubble_tokens": 0, "decoder_tokens": len(tokens)}


async def test_no_prompt_is_placed_on_a_decoder_that_is_not_alive(redis_url: str, redis: Redis) -> None:
    """placement decoder, but no decoder service's heartbeat: the prompt goes to the bubbles (and is
    answered from there), rather than wait out its deadline for a decoder that never comes."""
    client = await front_door(redis_url, "decoder", decoder_alive=False)
    try:
        call = asyncio.create_task(
            client.post("/v1/completions", json={"model": "bubbletea-gpt", "prompt": "x", "max_tokens": 1})
        )
        async with asyncio.timeout(30):
            while not (rows := await redis.xrange(keys.prefill_requests_stream(RUN))):  # noqa: ASYNC110
                await asyncio.sleep(0.02)  # a stream entry: no event to wait on in this test
        req = decode_msg(rows[0][1][FIELD])
        assert isinstance(req, PrefillRequest)
        done = PrefillResult(id=req.id, status=RequestStatus.DONE, token=65, text="A", prompt_tokens=1, worker="w")
        await serving.answer(redis, RUN, done, req.reply_to)
        resp = await call
        assert resp.status == 200, await resp.text()
        answer: dict[str, Any] = await resp.json()
    finally:
        await client.close()
    assert answer["choices"][0]["text"] == "A"
    assert answer["usage"]["prompt_tokens_details"] == {"bubble_tokens": 1, "decoder_tokens": 0}
