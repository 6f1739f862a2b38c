"""The decoder service against a real redis-server: it continues a prompt from the KV cache a
prefill stored (safetensors, as the workers store it), token for token as a local full generation
does, greedy and seeded, stops at a stop sequence, deletes the KV cache once used, and fails a
request whose KV cache is gone explicitly. Given the prompt itself (placed on the decoder), it
computes it and sends the first token at once, then the rest, as a local full generation does."""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import AsyncIterator
from typing import Any

import msgspec
import pytest
from redis.asyncio import Redis

from services.decoder.decoder import serve
from shared.bus import Bus
from shared.config.settings import Settings, load_settings
from shared.dataplane import kvstore
from shared.model.generate import generate
from shared.model.prefill import PrefillModel
from shared.model.tokenizer import decode
from shared.wire import FIELD, DecodeChunk, DecodeRequest, keys
from shared.wire import decode as decode_msg
from shared.wire.status import FailureReason, RequestStatus

REPLY = "bt:test:decode-replies"
RUN = "decode"
#: Where the run's front doors send what the decoder continues.
REQUESTS = keys.decode_requests_stream(RUN)


@pytest.fixture
def settings(redis_url: str) -> Settings:
    s = load_settings(None)
    decode_cfg = msgspec.structs.replace(s.spec.decode, enabled=True, chunk_ms=1.0)
    return dataclasses.replace(s, redis_url=redis_url, run=RUN, spec=msgspec.structs.replace(s.spec, decode=decode_cfg))


@pytest.fixture
async def decoder(settings: Settings) -> AsyncIterator[PrefillModel]:
    stop = asyncio.Event()
    task = asyncio.create_task(serve(settings, stop))
    yield PrefillModel.from_spec(settings.spec.prefill)  # the same weights the decoder loads
    stop.set()
    await asyncio.wait_for(task, 30)


async def prefill_and_store(redis: Redis, model: PrefillModel, rid: str, prompt: list[int], **kw: Any) -> int:
    res = model.prefill(prompt, **kw)
    await kvstore.store_kv(redis, RUN, rid, kvstore.kv_file(rid, "m", prompt, res.token, res.kv), ttl_s=60)
    return res.token


async def completion(redis: Redis, rid: str, cursor: str = "0") -> tuple[list[DecodeChunk], str]:
    chunks: list[DecodeChunk] = []
    async with asyncio.timeout(60):
        while not chunks or not chunks[-1].done:
            got: Any = await redis.xread({REPLY: cursor}, block=1000)
            for _, entries in got or []:
                for entry_id, fields in entries:
                    cursor = entry_id.decode()
                    msg = decode_msg(fields[FIELD])
                    if isinstance(msg, DecodeChunk) and msg.id == rid:
                        chunks.append(msg)
    return chunks, cursor


def request(rid: str, max_tokens: int, **kw: Any) -> DecodeRequest:
    return DecodeRequest(id=rid, model="m", max_tokens=max_tokens, submitted=time.time(), reply_to=REPLY, **kw)


@pytest.mark.parametrize("sampling", [{}, {"temperature": 0.9, "seed": 11}])
async def test_decoding_equals_a_local_full_generation(
    decoder: PrefillModel, redis: Redis, redis_url: str, sampling: dict[str, Any]
) -> None:
    prompt = list(b"Once upon a time")
    first = await prefill_and_store(redis, decoder, "r1", prompt, **sampling)
    async with Bus(redis_url, name="test") as bus:
        await bus.publish(REQUESTS, request("r1", 24, **sampling))
    chunks, _ = await completion(redis, "r1")
    tokens = [first] + [t for c in chunks for t in c.tokens]
    assert tokens == generate(decoder, prompt, 24, **sampling)
    assert [c.index for c in chunks] == [1 + sum(len(c.tokens) for c in chunks[:i]) for i in range(len(chunks))]
    assert chunks[-1].done and chunks[-1].finish_reason == "length" and chunks[-1].status is RequestStatus.DONE
    # used, then deleted: none left behind (the decoder deletes it after sending the last chunk)
    async with asyncio.timeout(60):
        while await redis.exists(keys.kv_cache_key(RUN, "r1")):  # noqa: ASYNC110
            await asyncio.sleep(0.02)  # a key's deletion: no event to wait on


async def test_a_stop_sequence_ends_the_completion(decoder: PrefillModel, redis: Redis, redis_url: str) -> None:
    prompt = list(b"abc")
    first = await prefill_and_store(redis, decoder, "r2", prompt)
    want = generate(decoder, prompt, 40)
    text = decode(want)
    stop = text[3:5]  # a piece of what greedy decoding will write
    async with Bus(redis_url, name="test") as bus:
        await bus.publish(REQUESTS, request("r2", 40, stop=(stop,)))
    chunks, _ = await completion(redis, "r2")
    tokens = [first] + [t for c in chunks for t in c.tokens]
    assert chunks[-1].finish_reason == "stop" and chunks[-1].stop_reason == stop
    assert len(tokens) < 40 and stop in decode(tokens) and tokens == want[: len(tokens)]


async def test_a_missing_kv_cache_fails_the_request_explicitly(
    decoder: PrefillModel, redis: Redis, redis_url: str
) -> None:
    async with Bus(redis_url, name="test") as bus:
        await bus.publish(REQUESTS, request("gone", 8))
    chunks, _ = await completion(redis, "gone")
    (last,) = chunks
    assert last.done and last.status is RequestStatus.FAILED and last.reason is FailureReason.KV_MISSING
    assert "no KV cache for gone" in last.error


@pytest.mark.parametrize("sampling", [{}, {"temperature": 0.9, "seed": 11}])
async def test_a_prompt_placed_on_the_decoder_is_computed_there_first_token_first(
    decoder: PrefillModel, redis: Redis, redis_url: str, sampling: dict[str, Any]
) -> None:
    """No KV cache stored anywhere: the request carries the prompt. Its first chunk (index 0) holds
    the first token alone, sent before any further token is generated; the whole completion equals
    a local full generation (the first token sampled as a bubble's prefill samples it)."""
    prompt = list(b"Placed on the decoder")
    async with Bus(redis_url, name="test") as bus:
        await bus.publish(REQUESTS, request("p1", 20, prompt=tuple(prompt), **sampling))
        await bus.publish(REQUESTS, request("p2", 1, prompt=tuple(prompt), **sampling))
    chunks, _ = await completion(redis, "p1")
    assert chunks[0].index == 0 and len(chunks[0].tokens) == 1 and not chunks[0].done
    tokens = [t for c in chunks for t in c.tokens]
    assert tokens == generate(decoder, prompt, 20, **sampling)
    assert chunks[0].tokens[0] == decoder.prefill(prompt, **sampling).token
    assert chunks[-1].done and chunks[-1].finish_reason == "length"
    (only,), _ = await completion(redis, "p2")  # max_tokens 1: the prompt's answer alone
    assert only.index == 0 and only.tokens == chunks[0].tokens and only.done and only.finish_reason == "length"


async def test_a_prompt_the_model_cannot_hold_fails_explicitly(
    decoder: PrefillModel, redis: Redis, redis_url: str
) -> None:
    too_long = tuple(range(256)) * 4  # past the model's positions (the front door checks; the decoder too)
    async with Bus(redis_url, name="test") as bus:
        await bus.publish(REQUESTS, request("p3", 4, prompt=too_long))
    (last,), _ = await completion(redis, "p3")
    assert last.done and last.status is RequestStatus.FAILED and last.reason is FailureReason.MODEL_REFUSED
    assert "cannot compute the prompt" in last.error


async def test_an_end_of_sequence_token_ends_the_completion(
    decoder: PrefillModel, redis: Redis, redis_url: str
) -> None:
    prompt = list(b"xyz")
    first = await prefill_and_store(redis, decoder, "r3", prompt)
    want = generate(decoder, prompt, 30)
    eos = want[5]  # a token greedy decoding writes: call it the end of sequence
    cut = want.index(eos)
    async with Bus(redis_url, name="test") as bus:
        await bus.publish(REQUESTS, request("r3", 30, eos=(eos,)))
    chunks, _ = await completion(redis, "r3")
    tokens = [first] + [t for c in chunks for t in c.tokens]
    assert tokens == want[: cut + 1] == generate(decoder, prompt, 30, eos=(eos,))  # it ends with the EOS token
    assert chunks[-1].finish_reason == "stop" and chunks[-1].stop_reason is None


async def test_the_decoder_serves_vllms_decode_metrics(decoder: PrefillModel, redis: Redis, redis_url: str) -> None:
    """GET /metrics (its URL in the heartbeat, as every bus service's): generation tokens, time per
    output token and inter-token latency under vLLM's names, completions by how they ended."""
    import aiohttp
    from prometheus_client.parser import text_string_to_metric_families

    from shared.control.health import live_instances

    await prefill_and_store(redis, decoder, "m1", list(b"metrics"))
    async with Bus(redis_url, name="test") as bus:
        await bus.publish(REQUESTS, request("m1", 12))
        await bus.publish(REQUESTS, request("m-gone", 4))
        await bus.publish(REQUESTS, request("m-here", 1, prompt=tuple(b"computed here")))
    await completion(redis, "m1")
    await completion(redis, "m-gone")
    await completion(redis, "m-here")
    async with asyncio.timeout(30):
        while not (live := await live_instances(redis, "decoder")) or not live[0].get("metrics_url"):  # noqa: ASYNC110
            await asyncio.sleep(0.05)  # a heartbeat key: no event to wait on
    async with aiohttp.ClientSession() as http, http.get(live[0]["metrics_url"]) as resp:
        text = await resp.text()
    samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for fam in text_string_to_metric_families(text)
        for s in fam.samples
    }
    model = (("model_name", load_settings(None).spec.prefill.model_name),)

    def value(name: str, **labels: str) -> float:
        return samples[(name, tuple(sorted({**dict(model), **labels}.items())))]

    assert value("bubbletea:generation_tokens_total") == 11  # 12 tokens, the first the prefill's
    assert value("bubbletea:inter_token_latency_seconds_count") == 11
    assert value("bubbletea:time_per_output_token_seconds_count") == 1
    assert value("bubbletea:request_success_total", finished_reason="length") == 2  # m1, and m-here at its first
    assert value("bubbletea:request_failures_total", reason="kv_missing") == 1
    assert value("bubbletea:decoder_prompt_tokens_total") == len(b"computed here")  # the bubbles' not counted
