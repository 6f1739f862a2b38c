"""KV caches on the data plane (`shared.dataplane.kv`, "bubbletea-kv-wire/1"), over real sockets: a
holder's caches reach a fetcher byte for byte on one kept connection, a freed or expired cache and
a holder that is gone each fail the fetch saying why (the latter at once), a client that leaves
mid-request or sends garbage costs the server that connection alone, and a holder restarted on the
same address is reconnected to."""

from __future__ import annotations

import asyncio
import socket
import struct
import time
from collections.abc import AsyncIterator

import pytest

from shared.config.spec import Prefill
from shared.dataplane import kvstore
from shared.dataplane.kv import (
    BAD_REQUEST,
    MAGIC,
    NOT_HELD,
    OK,
    OP_FETCH,
    OP_FREE,
    REQUEST,
    RESPONSE,
    KvServer,
    KvShelf,
)
from shared.dataplane.kv_client import KvClient
from shared.model.prefill import PrefillModel
from tests.e2e.serving import wait_until

HOST = "127.0.0.1"


@pytest.fixture
async def holder() -> AsyncIterator[KvServer]:
    server = KvServer(KvShelf(60, 1 << 30), HOST)
    await server.start()
    yield server
    await server.close()


@pytest.fixture
async def client() -> AsyncIterator[KvClient]:
    c = KvClient()
    yield c
    await c.close()


def a_kv_file(request_id: str) -> tuple[bytes, list[int]]:
    model = PrefillModel.from_spec(Prefill())
    prompt = list(range(1, 40))
    res = model.prefill(prompt)
    return kvstore.kv_file(request_id, "m", prompt, res.token, res.kv), prompt


async def raw_request(port: int, payload: bytes, then_closed: bool = True) -> tuple[int, bytes, bool]:
    """`payload` sent on a connection of its own, as a client in another language would: (status,
    body, and if `then_closed`, whether the server closed the connection after answering)."""
    reader, writer = await asyncio.open_connection(HOST, port)
    try:
        writer.write(payload)
        await writer.drain()
        magic, status, length = RESPONSE.unpack(await reader.readexactly(RESPONSE.size))
        assert magic == MAGIC
        body = await reader.readexactly(length)
        closed = then_closed and await asyncio.wait_for(reader.read(1), 5) == b""
        return status, body, closed
    finally:
        writer.close()


def request(op: int, rid: str) -> bytes:
    raw = rid.encode()
    return REQUEST.pack(MAGIC, op, len(raw)) + raw


async def test_a_held_kv_cache_reaches_the_fetcher_exactly_on_one_kept_connection(
    holder: KvServer, client: KvClient
) -> None:
    data, prompt = a_kv_file("r1")
    assert holder.shelf.put("r1", data, time.time()).key == "r1"
    assert holder.holder == f"{HOST}:{holder.port}" and holder.port > 0
    got, why = await client.fetch(holder.holder, "r1")
    assert got == data, why
    assert kvstore.read_kv_file(got).prompt == prompt
    again, _ = await client.fetch(holder.holder, "r1")
    assert again == data  # a fetch does not consume it: a restarted decode fetches again
    # concurrent requests to one holder take turns on the one connection
    many = await asyncio.gather(*(client.fetch(holder.holder, "r1") for _ in range(8)))
    assert all(g == data for g, _ in many)
    assert (holder.accepted, client.connects, holder.served) == (1, 1, 10)


async def test_fetch_free_then_fetch_again_fails_saying_so(holder: KvServer, client: KvClient) -> None:
    data, _ = a_kv_file("r2")
    holder.shelf.put("r2", data, time.time())
    got, why = await client.fetch(holder.holder, "r2")
    assert got == data, why
    assert await client.free(holder.holder, "r2") == (True, "")
    assert holder.held == 0 and holder.freed == 1
    got, why = await client.fetch(holder.holder, "r2")
    assert got is None and f"no KV cache for r2 on {holder.holder}" in why and "freed" in why, why
    freed, why = await client.free(holder.holder, "r2")  # a second free: nothing to drop, said so
    assert not freed and "r2" in why
    assert holder.accepted == 1


async def test_an_expired_or_unknown_cache_fails_the_fetch_saying_so(holder: KvServer, client: KvClient) -> None:
    data, _ = a_kv_file("old")
    holder.shelf.put("old", data, time.time() - 61)  # held 60 s: expired, not yet swept
    for rid in ("old", "never"):
        got, why = await client.fetch(holder.holder, rid)
        assert got is None and f"no KV cache for {rid}" in why and "expired" in why, why
    holder.shelf.expire(time.time())
    assert holder.held == 0


async def test_a_holder_that_is_gone_fails_the_fetch_at_once_saying_so(holder: KvServer, client: KvClient) -> None:
    data, _ = a_kv_file("r3")
    holder.shelf.put("r3", data, time.time())
    assert (await client.fetch(holder.holder, "r3"))[0] == data
    loop = asyncio.get_running_loop()
    errors: list[dict[str, object]] = []
    loop.set_exception_handler(lambda _, context: errors.append(context))
    try:
        await holder.close()  # the worker stops: its kept connection closes, its port refuses
        await asyncio.sleep(0.05)
    finally:
        loop.set_exception_handler(None)
    assert not errors, errors  # a clean stop: no handler's cancellation logged as an error
    t0 = time.monotonic()
    got, why = await client.fetch(holder.holder, "r3", timeout_s=5.0)
    assert got is None and why == f"the worker holding the KV cache of r3 ({holder.holder}) is gone: connection refused"
    freed, why = await client.free(holder.holder, "r3", timeout_s=5.0)
    assert not freed and "is gone" in why
    assert time.monotonic() - t0 < 2.0  # told, not timed out
    with socket.socket() as s:  # never listened on: refused as well
        s.bind((HOST, 0))
        port = s.getsockname()[1]
    got, why = await client.fetch(f"{HOST}:{port}", "r3")
    assert got is None and "is gone: connection refused" in why
    got, why = await client.fetch("run:r0s0:host-1", "r3")  # not an address
    assert got is None and "not a KV holder's address" in why


async def test_a_holder_that_does_not_answer_times_the_fetch_out(client: KvClient) -> None:
    async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.read()  # reads, never answers
        writer.close()

    server = await asyncio.start_server(silent, HOST, 0)
    try:
        port = server.sockets[0].getsockname()[1]
        got, why = await client.fetch(f"{HOST}:{port}", "r4", timeout_s=0.3)
        holder = f"{HOST}:{port}"
        assert got is None and why == f"the worker holding the KV cache of r4 ({holder}) did not answer within 0.3 s"
    finally:
        server.close()


async def test_a_client_that_leaves_mid_request_does_not_hurt_the_server(holder: KvServer, client: KvClient) -> None:
    data, _ = a_kv_file("r5")
    holder.shelf.put("r5", data, time.time())
    for partial in (request(OP_FETCH, "r5")[:5], request(OP_FETCH, "r5")):  # mid-header; before reading
        _, writer = await asyncio.open_connection(HOST, holder.port)
        writer.write(partial)
        await writer.drain()
        writer.transport.abort()  # gone at once (a reset), its answer unread
    # one that stops reading a large answer is dropped after the write timeout, not kept forever
    holder.shelf.put("big", b"z" * (32 << 20), time.time())
    holder.write_timeout_s = 0.5
    _, stuck = await asyncio.open_connection(HOST, holder.port)
    stuck.write(request(OP_FETCH, "big"))
    await stuck.drain()

    async def only_ours_left() -> bool:
        return holder.connections <= 1

    got, why = await client.fetch(holder.holder, "r5")
    assert got == data, why
    await wait_until(only_ours_left, "the server dropping the clients that left or stopped reading", timeout=10)
    stuck.close()
    got, why = await client.fetch(holder.holder, "r5")
    assert got == data, why


async def test_a_garbage_request_gets_bad_request_and_others_are_still_served(
    holder: KvServer, client: KvClient
) -> None:
    data, _ = a_kv_file("r6")
    holder.shelf.put("r6", data, time.time())
    got, _ = await client.fetch(holder.holder, "r6")  # a kept connection, open across the garbage
    assert got == data
    cases = [
        (b"GET / HTTP/1.1\r\nHost: x\r\n\r\n", "not a bubbletea-kv-wire/1 request"),
        (REQUEST.pack(MAGIC, 9, 2) + b"r6", "unknown op 9"),
        (REQUEST.pack(MAGIC, OP_FETCH, 1025) + b"x" * 1025, "at most 1024"),
        (REQUEST.pack(MAGIC, OP_FETCH, 2) + b"\xff\xfe", "not UTF-8"),
    ]
    for payload, says in cases:
        status, body, closed = await raw_request(holder.port, payload)
        assert status == BAD_REQUEST and says in body.decode() and closed, (payload, body)
    assert holder.refused == len(cases)
    got, why = await client.fetch(holder.holder, "r6")
    assert got == data, why
    # the protocol as written, spoken with the standard library alone: requests one after another
    status, body, _ = await raw_request(holder.port, request(OP_FETCH, "r6"), then_closed=False)
    assert (status, body) == (OK, data)
    reader, writer = await asyncio.open_connection(HOST, holder.port)
    try:
        writer.write(request(OP_FREE, "r6") + request(OP_FETCH, "r6"))
        await writer.drain()
        assert RESPONSE.unpack(await reader.readexactly(RESPONSE.size)) == (MAGIC, OK, 0)
        magic, status, length = struct.unpack("!4sBQ", await reader.readexactly(13))
        assert (magic, status) == (MAGIC, NOT_HELD) and b"r6" in await reader.readexactly(length)
    finally:
        writer.close()


async def test_a_holder_restarted_on_the_same_address_is_reconnected_to(holder: KvServer, client: KvClient) -> None:
    data, _ = a_kv_file("r7")
    holder.shelf.put("r7", data, time.time())
    assert (await client.fetch(holder.holder, "r7"))[0] == data
    port = holder.port
    await holder.close()
    again = KvServer(KvShelf(60, 1 << 30), HOST, port)
    assert await again.start() == holder.holder
    try:
        again.shelf.put("r7", data, time.time())
        got, why = await client.fetch(holder.holder, "r7")
        assert got == data, why
        assert (client.connects, again.accepted) == (2, 1)
    finally:
        await again.close()


async def test_a_connection_the_server_closed_while_idle_is_replaced_on_the_next_request(
    client: KvClient,
) -> None:
    server = KvServer(KvShelf(60, 1 << 30), HOST, idle_s=0.2)
    await server.start()
    try:
        server.shelf.put("r8", b"cache", time.time())
        assert await client.fetch(server.holder, "r8") == (b"cache", "")
        await asyncio.sleep(0.5)  # the server closed it meanwhile
        assert await client.fetch(server.holder, "r8") == (b"cache", "")
        assert (client.connects, server.accepted) == (2, 2)
    finally:
        await server.close()
