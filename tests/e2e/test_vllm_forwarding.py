"""The front door with `decode.engine: vllm` when vLLM cannot be reached: an explicit answer.

Real processes (front door, dispatcher, WAN broker, four stage workers) over a real redis-server;
the vLLM URL points at a port nothing listens on. The prompt is still prefilled in a bubble (its
first token computed); the continuation fails with a 503 that names the vLLM URL, and the prompt's
KV cache is not left behind on its worker. A real vLLM is in the vLLM tier (tests/vllm).
"""

from __future__ import annotations

import asyncio
import io
import uuid
from pathlib import Path

import aiohttp

from bubbletea.launcher.procs import front_door
from bubbletea.launcher.train import run_training
from shared.config.settings import load_settings
from shared.runtime.redis_server import free_port
from tests.e2e.serving import ONE_REPLICA, SPEC, service_env, wait_for_iteration, wait_until, write_spec
from tests.e2e.test_openai_client import _kv_held


async def test_an_unreachable_vllm_fails_the_completion_explicitly(tmp_path: Path, redis_url: str) -> None:
    dead = f"http://127.0.0.1:{free_port()}"
    path = write_spec(
        tmp_path,
        **ONE_REPLICA,
        training={**SPEC["training"], "iterations": 100_000},
        decode={"enabled": True, "engine": "vllm", "vllm_url": dead},
        prefill={**SPEC["prefill"], "placement": "bubbles"},  # the bubbles' path: vLLM only continues
    )
    run = f"vllm-fwd-{uuid.uuid4().hex[:6]}"
    settings = load_settings(path, env={"BUBBLETEA_RUN": run})
    slots = settings.spec.parallelism.pp * settings.spec.parallelism.dp  # every worker's heartbeat
    out = io.StringIO()
    async with front_door(service_env(redis_url, path, run), out=out) as door:
        training = asyncio.create_task(run_training(settings, redis_url, out=out, progress=False, dispatcher=True))
        try:
            await wait_for_iteration(redis_url, run, 1)
            async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as http:
                async with http.post(
                    f"{door.url}/v1/completions", json={"prompt": "Hello", "max_tokens": 4, "temperature": 0}
                ) as resp:
                    body = await resp.json()
                    status = resp.status

                async def freed() -> bool:  # vLLM never took it: the front door freed its cache
                    held = await _kv_held(redis_url, run)
                    return len(held) == slots and not any(h for _, h in held.values())

                await wait_until(freed, "the unused KV cache freed on its worker", timeout=30)
                # the same prompt's prefill alone still works, and says where its cache is
                async with http.post(
                    f"{door.url}/v1/completions", json={"prompt": "Hello", "max_tokens": 1, "temperature": 0}
                ) as resp:
                    assert resp.status == 200, await resp.text()
                    handle = (await resp.json())["kv_transfer_params"]
        finally:
            training.cancel()
            await asyncio.gather(training, return_exceptions=True)
    assert status == 503, body
    assert dead in body["error"]["message"] and "unreachable" in body["error"]["message"], body
    assert handle["store"] == "plane" and handle["prompt_tokens"] == 5 and ":" in handle["holder"]
