"""A front door told to stop (SIGTERM) stops accepting, gives the requests in flight their answer
if it lands within the grace period and a JSON 503 saying where it will be otherwise, and returns:
over real HTTP, with the server as `python -m services.prefill_queue` runs it, and a real Redis."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from redis.asyncio import Redis

from services.prefill_queue import state
from services.prefill_queue.app import create_app
from services.prefill_queue.server import Runner
from services.prefill_queue.state import STOPPING
from shared.config.settings import load_settings
from shared.control import serving
from shared.service.main import serve_app
from shared.wire import FIELD, PrefillRequest, PrefillResult, decode, keys
from shared.wire.status import RequestStatus

#: The grace period when the answer does not come: the test waits it out. When the answer comes,
#: the production grace (`state.STOP_GRACE_S`, 5 s) leaves it all the time a busy machine needs.
GRACE_S = 1.0
RUN = "stop"


async def start(redis_url: str) -> tuple[asyncio.Event, asyncio.Task[None], str, web.Application]:
    stop = asyncio.Event()
    listening: asyncio.Future[str] = asyncio.get_running_loop().create_future()
    app = create_app(load_settings(env={"REDIS_URL": redis_url, "BUBBLETEA_RUN": RUN}))
    task = asyncio.create_task(
        serve_app(app, "127.0.0.1", 0, stop, on_listening=listening.set_result, runner_class=Runner)
    )
    return stop, task, await asyncio.wait_for(listening, 30), app


async def first_request(redis: Redis) -> PrefillRequest:
    got: Any = await redis.xread({keys.prefill_requests_stream(RUN): "0"}, count=1, block=30_000)
    assert got, "the request never reached the stream"
    msg = decode(got[0][1][0][1][FIELD])
    assert isinstance(msg, PrefillRequest)
    return msg


@pytest.mark.parametrize("answered_in_grace", [True, False])
async def test_a_stopping_front_door_answers_or_fails_what_is_in_flight(
    redis_url: str, redis: Redis, monkeypatch: pytest.MonkeyPatch, answered_in_grace: bool
) -> None:
    if not answered_in_grace:
        monkeypatch.setattr(state, "STOP_GRACE_S", GRACE_S)
    stop, server, url, app = await start(redis_url)
    async with aiohttp.ClientSession() as http:
        call = asyncio.create_task(http.post(f"{url}/v1/completions", json={"prompt": "hi"}))
        req = await first_request(redis)
        t0 = time.monotonic()
        stop.set()  # what SIGTERM does
        if answered_in_grace:
            # the answer lands once the front door has begun to stop: during its grace period
            await asyncio.wait_for(app[STOPPING].event.wait(), 30)
            result = PrefillResult(id=req.id, status=RequestStatus.DONE, token=65, text="A", prompt_tokens=2)
            assert await serving.answer(redis, RUN, result, req.reply_to)
        resp = await asyncio.wait_for(call, 60)
        body: Any = await resp.json()
        if answered_in_grace:
            assert resp.status == 200 and body["choices"][0]["text"] == "A"
        else:
            assert resp.status == 503 and resp.headers["Retry-After"] == "1"
            assert body["error"]["type"] == "service_unavailable"
            assert f"GET /v1/prefill/{req.id}" in body["error"]["message"]  # it stays queued, its answer kept
            assert time.monotonic() - t0 >= GRACE_S  # failed only once the whole grace period had passed
        await asyncio.wait_for(server, 30)  # the server returns: the process exits 0
        with pytest.raises(aiohttp.ClientConnectionError):
            await http.get(f"{url}/health")  # and no longer listens
    assert (await serving.lookup(redis, RUN, req.id)) is not None  # nothing lost: queued, or answered
