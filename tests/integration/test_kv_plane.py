"""KV caches on the data plane (`shared.dataplane.kv`), over a real redis-server and real gloo: a
holder's caches reach a fetcher byte for byte, Redis carries only the requests, a freed or
expired cache and a holder that is gone each fail the fetch saying why, and a fetcher that never
comes does not block the holder."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator

import pytest
from redis.asyncio import Redis

from shared import keys, kvstore
from shared.bus import Bus
from shared.config import Prefill
from shared.dataplane import kv as kv_plane
from shared.dataplane.kv import KvServer, KvShelf
from shared.model.prefill import PrefillModel
from shared.wire import KvFetch
from tests.e2e.serving import wait_until

pytestmark = pytest.mark.integration

HOST = "127.0.0.1"


@pytest.fixture
async def holder(redis_url: str) -> AsyncIterator[KvServer]:
    async with Bus(redis_url) as bus:
        server = KvServer(bus, redis_url, f"test:{uuid.uuid4().hex[:6]}", HOST, KvShelf(60, 1 << 30), timeout_s=2.0)
        await server.start()
        yield server
        await server.close()


def a_kv_file(request_id: str) -> tuple[bytes, list[int]]:
    model = PrefillModel.from_spec(Prefill())
    prompt = list(range(1, 40))
    res = model.prefill(prompt)
    return kvstore.kv_file(request_id, "m", prompt, res.token, res.kv), prompt


async def test_a_held_kv_cache_reaches_the_fetcher_exactly_and_redis_never_holds_it(
    holder: KvServer, redis_url: str, redis: Redis
) -> None:
    data, prompt = a_kv_file("r1")
    assert holder.shelf.put("r1", data, time.time()).key == "r1"
    async with Bus(redis_url) as bus:
        got, why = await kv_plane.fetch(bus, redis_url, holder.holder, "r1", HOST, "test")
        assert got == data, why
        assert kvstore.read_kv_file(got).prompt == prompt
        again, _ = await kv_plane.fetch(bus, redis_url, holder.holder, "r1", HOST, "test")
        assert again == data  # a fetch does not consume it: a restarted decode fetches again
    biggest = 0
    async for key in redis.scan_iter():
        kind = (await redis.type(key)).decode()
        size = await redis.memory_usage(key) if kind in ("string", "stream") else 0
        biggest = max(biggest, size or 0)
    assert biggest < len(data) // 4, f"a Redis key of {biggest} bytes: the {len(data)}-byte cache went through Redis"


async def test_a_freed_or_expired_cache_fails_the_fetch_saying_so(holder: KvServer, redis_url: str) -> None:
    data, _ = a_kv_file("r2")
    holder.shelf.put("r2", data, time.time())
    holder.shelf.put("old", data, time.time() - 61)  # held 60 s: expired
    async with Bus(redis_url) as bus:
        await kv_plane.delete(bus, holder.holder, "r2")

        async def freed() -> bool:
            return "r2" not in holder.shelf.held

        await wait_until(freed, "the holder freeing r2")
        for rid in ("r2", "old", "never"):
            got, why = await kv_plane.fetch(bus, redis_url, holder.holder, rid, HOST, "test")
            assert got is None and f"no KV cache for {rid}" in why and "expired" in why


async def test_a_holder_that_is_gone_fails_the_fetch_within_its_timeout(redis_url: str) -> None:
    async with Bus(redis_url) as bus:
        t0 = time.monotonic()
        got, why = await kv_plane.fetch(bus, redis_url, "gone:r0s0:x", "r3", HOST, "test", timeout_s=1.0)
    assert got is None and "gone:r0s0:x" in why and "did not answer" in why
    assert time.monotonic() - t0 < 10


async def test_a_fetcher_that_never_comes_does_not_block_the_holder(holder: KvServer, redis_url: str) -> None:
    data, _ = a_kv_file("r4")
    holder.shelf.put("r4", data, time.time())
    async with Bus(redis_url) as bus:
        stream = keys.kv_holder_stream(holder.holder)
        ghost = KvFetch(id="r4", rendezvous=keys.kv_rendezvous(holder.holder, "ghost"), fetcher="ghost")
        await bus.publish(stream, ghost)
        got, why = await asyncio.wait_for(kv_plane.fetch(bus, redis_url, holder.holder, "r4", HOST, "test"), 30)
    assert got == data, why
