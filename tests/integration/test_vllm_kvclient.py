"""The vLLM connector's own client (`bubbletea_vllm.kvclient`: blocking, standard library only)
against a real worker-side `KvServer`: the same protocol from the other implementation. It fetches
byte for byte on one kept connection, frees, says why a cache is not there, survives the holder's
restart on the same address, and fails at once, naming the holder, when the holder is gone."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import pytest
from bubbletea_vllm.handle import check, metadata, parse_handle
from bubbletea_vllm.kvclient import KvClient, KvUnavailable

from shared.dataplane.kv import KvServer, KvShelf
from tests.integration.test_kv_plane import HOST, a_kv_file


@pytest.fixture
async def holder() -> AsyncIterator[KvServer]:
    server = KvServer(KvShelf(60, 1 << 30), HOST)
    await server.start()
    yield server
    await server.close()


async def test_fetch_on_one_kept_connection_then_free(holder: KvServer) -> None:
    data, prompt = a_kv_file("v1")
    holder.shelf.put("v1", data, time.time())
    client = KvClient(timeout_s=5)
    try:
        got = [await asyncio.to_thread(client.fetch, holder.holder, "v1") for _ in range(3)]
        assert got == [data] * 3
        assert (client.connects, holder.accepted) == (1, 1)  # one connection, kept
        # what the connector checks before loading: ours, and this prompt's
        h = parse_handle({"remote_engine_id": "bubbletea", "store": "plane", "key": "v1", "holder": holder.holder,
                          "prompt_tokens": len(prompt)})  # fmt: skip
        assert h is not None
        check(metadata(got[0]), h, [*prompt, 7], len(prompt))
        assert await asyncio.to_thread(client.free, holder.holder, "v1")
        assert holder.held == 0
        assert not await asyncio.to_thread(client.free, holder.holder, "v1")  # freed already: harmless
        with pytest.raises(KvUnavailable, match="v1"):
            await asyncio.to_thread(client.fetch, holder.holder, "v1")
    finally:
        client.close()


async def test_a_restarted_holder_is_reconnected_and_a_gone_one_named_at_once(holder: KvServer) -> None:
    data, _ = a_kv_file("v2")
    holder.shelf.put("v2", data, time.time())
    client = KvClient(timeout_s=5)
    try:
        assert await asyncio.to_thread(client.fetch, holder.holder, "v2") == data
        port = holder.port
        await holder.close()  # the kept connection dies with it
        again = KvServer(KvShelf(60, 1 << 30), HOST, port)
        await again.start()
        try:
            again.shelf.put("v2", data, time.time())
            assert await asyncio.to_thread(client.fetch, holder.holder, "v2") == data
            assert client.connects == 2
        finally:
            await again.close()
        t0 = time.monotonic()
        with pytest.raises(KvUnavailable, match=rf"\({holder.holder}\) is gone"):
            await asyncio.to_thread(client.fetch, holder.holder, "v2")
        assert time.monotonic() - t0 < 2.0  # refused, not timed out
    finally:
        client.close()
