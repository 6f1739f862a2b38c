"""Hostile and careless HTTP clients against the real front door (`serve_app` with the service's own
`Runner`, as `python -m services.prefill_queue` starts it) over real sockets, with a real redis-server.

Every error is JSON in the API's error shape, deep JSON is refused before it is parsed, a non-JSON
body gets a 415, a client trickling its headers is cut off, and client errors are logged in one
line, never as a traceback.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from msgspec.structs import replace
from redis.asyncio import Redis

from services.prefill_queue.app import create_app
from services.prefill_queue.server import Runner
from services.prefill_queue.validation import MAX_JSON_DEPTH, json_too_deep
from shared.config.settings import Settings
from shared.control import serving
from shared.runtime.logs import KeyValueFormatter
from shared.service.main import serve_app
from tests.integration.test_prefill_api import REQUESTS, RUN, ok_result, settings_for, take_requests

HEADER_TIMEOUT_S = 1.0


@contextlib.asynccontextmanager
async def front_door(settings: Settings) -> AsyncIterator[str]:
    """The front door on a free port, as production starts it (header timeout shortened); its URL."""
    stop = asyncio.Event()
    listening: asyncio.Future[str] = asyncio.get_running_loop().create_future()

    def runner(app: web.Application, **kw: Any) -> Runner:
        return Runner(app, header_timeout_s=HEADER_TIMEOUT_S, **kw)

    app = create_app(settings)
    task = asyncio.create_task(
        serve_app(app, "127.0.0.1", 0, stop, on_listening=listening.set_result, runner_class=runner)
    )
    try:
        yield await asyncio.wait_for(listening, 30)
    finally:
        stop.set()
        await asyncio.wait_for(task, 30)


@pytest.fixture
async def server(redis_url: str) -> AsyncIterator[str]:
    async with front_door(settings_for(redis_url, BUBBLETEA_API_KEY="s3cret")) as url:
        yield url


AUTH = {"Authorization": "Bearer s3cret"}
JSON = {"Content-Type": "application/json"}


async def call(url: str, method: str, path: str, **kw: Any) -> tuple[int, dict[str, Any], str]:
    headers = {**AUTH, **kw.pop("headers", {})}
    async with aiohttp.ClientSession() as s, s.request(method, url + path, headers=headers, **kw) as r:
        return r.status, dict(r.headers), await r.text()


def assert_error_shape(text: str, status: int) -> dict[str, Any]:
    err = json.loads(text)["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["code"] == status
    assert isinstance(err["message"], str) and err["message"]
    return err


async def raw(url: str, data: bytes, *, read_timeout: float = 30.0) -> bytes:
    """Send raw bytes, read until the server closes."""
    host, port = url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    writer.write(data)
    await writer.drain()
    try:
        return await asyncio.wait_for(reader.read(), read_timeout)
    finally:
        writer.close()


def raw_json(answer: bytes) -> tuple[int, dict[str, Any]]:
    head, _, body = answer.partition(b"\r\n\r\n")
    status = int(head.split(b" ")[1])
    assert b"content-type: application/json" in head.lower(), head
    return status, json.loads(body)


# --- 1. every error is JSON --------------------------------------------------------------------


@pytest.mark.parametrize(
    ("method", "path", "kw", "status", "fragment"),
    [
        ("GET", "/nope", {}, 404, "Not Found"),
        ("GET", "/v1/completions", {}, 405, "allowed: POST"),
        ("DELETE", "/v1/prefill", {}, 405, "method DELETE is not allowed"),
        ("POST", "/v1/prefill", {"json": {"prompt": "z" * 5000}}, 413, "larger than 4096 bytes"),
        ("POST", "/v1/prefill", {"data": b"{not json", "headers": {"Content-Type": "application/json"}}, 400, "JSON"),
        ("POST", "/v1/completions", {"data": b"[" * 4000, "headers": {"Content-Type": "application/json"}}, 400,
         f"nested deeper than {MAX_JSON_DEPTH}"),
        ("POST", "/v1/prefill", {"data": b'{"prompt": ' + b"[" * 100 + b"1" + b"]" * 100 + b"}",
                                 "headers": {"Content-Type": "application/json"}}, 400, "nested deeper"),
        ("POST", "/v1/prefill", {"data": b"\xff\xfe", "headers": {"Content-Type": "application/json"}}, 400, "JSON"),
        ("GET", "/v1/models", {"headers": {"Authorization": "Basic czNjcmV0"}}, 401, "API key"),
    ],
)  # fmt: skip
async def test_every_error_is_json_in_the_api_shape(
    server: str, redis: Redis, method: str, path: str, kw: dict[str, Any], status: int, fragment: str
) -> None:
    got, headers, text = await call(server, method, path, **kw)
    assert got == status and headers["Content-Type"].startswith("application/json"), text
    assert fragment in assert_error_shape(text, status)["message"]
    if status == 405:
        assert headers["Allow"]
    assert await redis.xlen(REQUESTS) == 0


async def test_json_nested_10000_deep_gets_a_400_not_a_500(redis_url: str) -> None:
    """At the default body limit (1 MiB) the parser would recurse 10,000 levels."""
    s = settings_for(redis_url)
    s = Settings(**{**s.__dict__, "spec": replace(s.spec, prefill=replace(s.spec.prefill, max_body_bytes=1 << 20))})
    async with front_door(s) as url:
        for body in (b"[" * 10_000 + b"]" * 10_000, b'{"prompt": ' + b'{"a": ' * 10_000 + b"1" + b"}" * 10_001):
            got, _, text = await call(url, "POST", "/v1/completions", data=body, headers=JSON)
            assert got == 400 and "nested deeper than 64" in assert_error_shape(text, 400)["message"]


def test_depth_check_ignores_brackets_in_strings_and_is_exact_at_the_limit() -> None:
    assert not json_too_deep(b"[" * 64 + b"]" * 64)
    assert json_too_deep(b"[" * 65 + b"]" * 65)
    assert json_too_deep(b"[" * 65)  # unclosed: still refused, the parser would recurse as deep
    assert not json_too_deep(json.dumps({"prompt": "[" * 1000 + '\\"{' * 100}).encode())
    assert not json_too_deep(json.dumps([[1, 2]] * 10_000).encode())  # wide is fine
    assert json_too_deep(b"[" * (1 << 20))  # a whole 1 MiB body of brackets, iteratively


async def test_a_malformed_request_line_or_header_gets_a_json_400(server: str) -> None:
    status, body = raw_json(await raw(server, b"GET /health HTTP/1.1\r\nHost: x\r\nBad Header\r\n\r\n"))
    assert status == 400 and assert_error_shape(json.dumps(body), 400)
    huge = b"GET /health HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 9000 + b"\r\n\r\n"
    status, body = raw_json(await raw(server, huge))
    assert status == 400 and body["error"]["code"] == 400


# --- 2. 415 --------------------------------------------------------------------------------------


@pytest.mark.parametrize("ctype", ["text/plain", "application/x-www-form-urlencoded", "application/octet-stream"])
async def test_a_body_that_is_not_declared_json_gets_415_naming_the_type(server: str, redis: Redis, ctype: str) -> None:
    got, _, text = await call(server, "POST", "/v1/prefill", data=b'{"prompt": "x"}', headers={"Content-Type": ctype})
    err = assert_error_shape(text, 415)
    assert got == 415 and "application/json" in err["message"] and ctype in err["message"]
    assert err["param"] == "Content-Type"
    assert await redis.xlen(REQUESTS) == 0


async def test_json_content_type_with_charset_and_a_missing_content_type_are_accepted(server: str) -> None:
    charset = {"Content-Type": "application/json; charset=utf-8"}
    got, _, _ = await call(server, "POST", "/v1/prefill", data=b'{"prompt": "x"}', headers=charset)
    assert got == 202
    body = b'{"prompt": "x"}'
    req = (
        b"POST /v1/prefill HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer s3cret\r\nConnection: close\r\n"
        + f"Content-Length: {len(body)}\r\n\r\n".encode()
        + body
    )
    status, answer = raw_json(await raw(server, req))
    assert status == 202 and answer["status"] == "queued"


# --- 3. slowloris ------------------------------------------------------------------------------


async def test_a_client_trickling_its_headers_is_cut_off(server: str) -> None:
    host, port = server.removeprefix("http://").split(":")
    t0 = time.monotonic()  # before the connection exists: the server's header timer starts later
    reader, writer = await asyncio.open_connection(host, int(port))
    sent = 0

    async def trickle() -> None:  # ~3 bytes/s, never a whole header: only the timeout ends it
        nonlocal sent
        for byte in b"GET /health HTTP/1.1\r\nHost: x\r\nX-Slow: " + b"a" * 1000:
            writer.write(bytes([byte]))
            await writer.drain()
            sent += 1
            await asyncio.sleep(0.3)

    trickling = asyncio.create_task(trickle())
    try:
        # The server answers only when it cuts the client off (the trickle lasts five minutes).
        try:
            got = await asyncio.wait_for(reader.read(), 60)
        except TimeoutError:
            pytest.fail("the server kept a trickling client connected")
        closed_after = time.monotonic() - t0
        assert got, "the server closed the connection without an answer"
        status, body = raw_json(got)
        assert status == 408 and "did not arrive within" in body["error"]["message"]
        assert sent > 0 and not trickling.done()  # cut off while still trickling
        assert closed_after >= HEADER_TIMEOUT_S  # not before its time
    finally:
        trickling.cancel()
        await asyncio.gather(trickling, return_exceptions=True)
        writer.close()


async def test_a_connection_that_sends_nothing_is_closed_and_a_prompt_one_is_served(server: str) -> None:
    host, port = server.removeprefix("http://").split(":")
    t0 = time.monotonic()  # before the connection exists: the server's header timer starts later
    reader, writer = await asyncio.open_connection(host, int(port))
    got = await asyncio.wait_for(reader.read(), 60)
    assert time.monotonic() - t0 >= HEADER_TIMEOUT_S and b" 408 " in got.split(b"\r\n")[0]
    writer.close()
    # A keep-alive client that pauses between requests (longer than the header timeout) is not cut off.
    async with aiohttp.ClientSession() as s:
        async with s.get(server + "/health") as r:
            assert r.status == 200
        await asyncio.sleep(HEADER_TIMEOUT_S * 1.5)
        async with s.get(server + "/health") as r:
            assert r.status == 200


# --- 4. Authorization scheme ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("value", "status"),
    [
        ("Bearer s3cret", 200),
        ("bearer s3cret", 200),
        ("BEARER s3cret", 200),
        ("Bearer  s3cret", 200),
        ("Bearer s3cre", 401),
        ("Basic s3cret", 401),
        ("s3cret", 401),
        ("Bearer", 401),
        ("", 401),
    ],
)
async def test_the_bearer_scheme_is_case_insensitive(server: str, value: str, status: int) -> None:
    got, _, text = await call(server, "GET", "/v1/models", headers={"Authorization": value})
    assert got == status, text


# --- 5. logs -------------------------------------------------------------------------------------


async def test_client_errors_are_logged_in_one_line_without_a_traceback(
    server: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    await call(server, "GET", "/nope")
    await call(server, "POST", "/v1/prefill", data=b"[" * 2000, headers={"Content-Type": "application/json"})
    await call(server, "POST", "/v1/prefill", data=b"x", headers={"Content-Type": "text/plain"})
    await call(server, "GET", "/v1/models", headers={"Authorization": "nope"})
    await raw(server, b"GET /health HTTP/1.1\r\nHost: x\r\nBad Header\r\n\r\n")
    await raw(server, b"GET /health HTTP/1.1\r\nX-Big: " + b"a" * 9000 + b"\r\n\r\n")
    await raw(server, b"\x16\x03\x01\x00\xa5\x01\x00\x00\xa1\x03\x03")  # TLS to the HTTP port
    await raw(server, b"GET /health HTTP/1.1\r\n")  # and then nothing: the header timeout
    records = [r for r in caplog.records if r.name.startswith(("services", "aiohttp", "shared"))]
    assert not [r for r in records if r.levelno >= logging.ERROR or r.exc_info], [r.getMessage() for r in records]
    statuses = [getattr(r, "fields", {}).get("status") for r in records]
    assert {404, 400, 415, 401} <= set(statuses)
    assert any("headers not received" in r.getMessage() for r in records)
    for r in records:
        assert "\n" not in KeyValueFormatter().format(r)


async def test_a_client_gone_mid_stream_is_logged_in_one_line_without_a_traceback(
    server: str, redis: Redis, caplog: pytest.LogCaptureFixture
) -> None:
    """A streaming client that hangs up before its last answer: the write that finds the
    connection closed is a client leaving, not a server error (no traceback, no 500 logged)."""
    caplog.set_level(logging.DEBUG)
    body = json.dumps({"prompt": ["ab", "cd"], "stream": True}).encode()
    host, port = server.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    writer.write(
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer s3cret\r\n"
        b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body)
    )
    await writer.drain()
    first, second = await take_requests(redis, 2)
    assert await serving.answer(redis, RUN, ok_result(first, 65), first.reply_to)
    assert b"200" in await asyncio.wait_for(reader.readline(), 30)  # the stream began
    writer.close()
    await writer.wait_closed()
    await asyncio.sleep(0.2)
    assert await serving.answer(redis, RUN, ok_result(second, 66), second.reply_to)
    for _ in range(100):  # the handler writes the second answer to the closed connection
        if any("closed the connection" in r.getMessage() for r in caplog.records):
            break
        await asyncio.sleep(0.05)
    records = [r for r in caplog.records if r.name.startswith(("services", "aiohttp", "shared"))]
    assert not [r for r in records if r.levelno >= logging.ERROR or r.exc_info], [r.getMessage() for r in records]
    assert any("closed the connection" in r.getMessage() for r in records)
    status, _, _ = await call(server, "GET", "/health")
    assert status == 200


# --- 6. generated requests from /openapi.json ----------------------------------------------------


def test_generated_requests_get_no_server_error_and_match_the_schema(redis_server: Any) -> None:
    pytest.importorskip("schemathesis")
    import redis as sync_redis

    from bench.fuzz import fuzz, fuzz_settings, serving

    sync_redis.Redis.from_url(redis_server.url).flushall()
    with serving(fuzz_settings(redis_server.url)) as url:
        totals = fuzz(url, 150, seed=1)
    assert totals["cases"] >= 50  # the generator really ran (seeded: the same cases every run)
    assert totals["server_errors"] == 0 and totals["schema_mismatches"] == 0, totals["examples"]
