"""The prefill_queue app over real HTTP (aiohttp test server) against a real redis-server."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from aiohttp.test_utils import TestClient, TestServer
from redis.asyncio import Redis

from services.prefill_queue.app import create_app
from shared.config.settings import Settings, load_settings
from shared.runtime.redis_server import EmbeddedRedis
from shared.wire import keys


def settings_for(url: str) -> Settings:
    return load_settings(env={"REDIS_URL": url})


@pytest.fixture
async def client(redis_url: str) -> AsyncIterator[TestClient]:
    async with TestClient(TestServer(create_app(settings_for(redis_url)))) as c:
        yield c


async def test_health_ok_when_redis_answers(client: TestClient) -> None:
    resp = await client.get("/health")
    assert resp.status == 200
    body = await resp.json()
    assert body["status"] == "ok" and body["redis"] == "ok" and body["service"] == "prefill_queue"


async def test_metrics_count_requests_by_route_and_status(client: TestClient) -> None:
    await client.get("/health")
    await client.get("/health")
    await client.get("/no-such-route")
    text = await (await client.get("/metrics")).text()
    assert 'bubbletea_http_requests_total{method="GET",route="/health",status="200"} 2.0' in text
    assert 'route="unmatched",status="404"' in text
    assert "bubbletea_redis_up 1.0" in text
    assert "process_resident_memory_bytes" in text


async def test_errors_are_json(client: TestClient) -> None:
    resp = await client.get("/no-such-route")
    assert resp.status == 404
    body = await resp.json()
    assert body["error"]["code"] == 404 and body["error"]["message"] == "Not Found"
    resp = await client.post("/health")
    assert resp.status == 405 and (await resp.json())["error"]["code"] == 405


async def test_heartbeat_key_lives_while_the_app_runs(redis_url: str, redis: Redis) -> None:
    async with TestClient(TestServer(create_app(settings_for(redis_url)))):
        beats = [k async for k in redis.scan_iter(match=keys.HEALTH_KEY_PATTERN)]
        assert len(beats) == 1 and b"prefill_queue" in beats[0]
        assert 0 < await redis.pttl(beats[0]) <= 6000
    assert [k async for k in redis.scan_iter(match=keys.HEALTH_KEY_PATTERN)] == []


async def test_health_503_when_redis_is_down(tmp_path: Path) -> None:
    server = EmbeddedRedis().start()
    try:
        async with TestClient(TestServer(create_app(settings_for(server.url)))) as c:
            assert (await c.get("/health")).status == 200
            server.kill()
            resp = await c.get("/health")
            assert resp.status == 503
            body = await resp.json()
            assert body["status"] == "unavailable" and body["redis"]
            assert "bubbletea_redis_up 0.0" in await (await c.get("/metrics")).text()
    finally:
        server.stop()
