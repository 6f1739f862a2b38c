"""A failing guest never stops the owner, live: every stage worker's prefill model fails on every
block (`BUBBLETEA_CHAOS_PREFILL=raise`, services/stage_worker/chaos.py), and training goes on to
the same losses as the single-process reference, every request is failed explicitly, the workers
stop taking prefill and stop announcing bubbles, and the front door's /ready says why.

Real processes (front door, dispatcher, WAN broker, two stage workers) over a real redis-server.
"""

from __future__ import annotations

import asyncio
import io
import re
import uuid
from pathlib import Path

import aiohttp
import pytest
from redis.asyncio import Redis

from bubbletea.launcher.procs import front_door
from bubbletea.launcher.train import run_training
from services.stage_worker import chaos
from shared.config.settings import load_settings
from shared.control.health import live_instances
from shared.model.reference import train_reference_for
from shared.runtime.redis_server import EmbeddedRedis
from tests.e2e.serving import ONE_REPLICA, SPEC, final_answers, service_env, submit, wait_ready, wait_until, write_spec


async def test_training_goes_on_to_the_reference_losses_while_every_prefill_fails(
    tmp_path: Path, redis_server: EmbeddedRedis, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(chaos.ENV, "raise")  # the launcher's environment is its workers'
    path = write_spec(tmp_path, **ONE_REPLICA, training={**SPEC["training"], "iterations": 6})
    run = f"guest-{uuid.uuid4().hex[:6]}"
    settings = load_settings(path, env={"BUBBLETEA_RUN": run})
    env = service_env(redis_server.url, path, run)
    out = io.StringIO()
    checked: asyncio.Future[None] = asyncio.get_running_loop().create_future()
    async with front_door(env, out=out) as door, aiohttp.ClientSession() as http:
        assert door.url is not None
        training = asyncio.create_task(
            run_training(settings, redis_server.url, out=out, progress=False, dispatcher=True, until=checked)
        )
        try:
            await wait_ready(http, door.url, timeout=90)
            ids = [await submit(http, door.url, {"prompt": [1 + i, 2, 3], "max_tokens": 1}) for i in range(8)]
            answers = await final_answers(http, door.url, ids, timeout=120)

            async def says_why() -> bool:
                async with http.get(f"{door.url}/ready") as resp:
                    return resp.status == 503 and "stopped taking prefill" in await resp.text()

            await wait_until(says_why, "/ready saying no worker takes prefill", timeout=60)
            # no worker announces a bubble any more (the dispatcher handles a worker's bubble
            # events in order, so every start sent before its PrefillOff is counted already)
            metrics = await dispatcher_metrics(redis_server.url, run)
            before = await bubble_starts(http, metrics)
            await asyncio.sleep(1.5)  # a few iterations
            assert await bubble_starts(http, metrics) == before > 0
            assert not training.done(), out.getvalue()[-3000:]  # it trains on
        finally:
            checked.set_result(None)
        result = await asyncio.wait_for(training, 120)

    # every request failed explicitly: by the model (a worker's failed batch), or as unavailable
    # once no worker took prefill; none was answered, none lost
    reasons = [a.get("reason") for a in answers.values()]
    assert all(a["status"] == "failed" for a in answers.values()), answers
    assert "prefill_error" in reasons and set(reasons) <= {"prefill_error", "unavailable"}, reasons
    # training: the same losses as without prefill
    expected, _ = train_reference_for(settings.spec)
    assert result.losses == pytest.approx(expected, abs=1e-5)
    # each worker said it stopped, and the dispatcher heard it
    for worker in ("r0s0", "r0s1"):
        assert f'msg="worker takes no more prefill" worker={worker}' in out.getvalue(), out.getvalue()[-3000:]


async def dispatcher_metrics(redis_url: str, run: str) -> str:
    r = Redis.from_url(redis_url, protocol=2)
    try:
        (inst,) = [i for i in await live_instances(r, "dispatcher") if i.get("run") == run]
    finally:
        await r.aclose()
    return str(inst["metrics_url"])


async def bubble_starts(http: aiohttp.ClientSession, url: str) -> float:
    """Bubble starts the dispatcher handled (its histogram of the work held as each opened)."""
    async with http.get(url) as resp:
        text = await resp.text()
    found = re.search(r"^bubbletea:bubble_start_queued_seconds_count\{[^}]*\} (\S+)$", text, re.M)
    assert found, text[:2000]
    return float(found.group(1))
