"""Nothing of tensor size rides Redis (docs/architecture.md, "What may ride Redis"), on a real run.

`bubbletea train --save` with checkpoints after every iteration and a BubbleTea dispatcher, PP=2 x
DP=2 worker processes over a real redis-server, while the front door takes prompts long enough that
each KV cache (and a preempted prompt's snapshot) is over 64 KiB. A MONITOR connection sees every
command any process sends to Redis, Lua scripts' and transactions' included: none may carry an
argument (a key, a value, a stream entry's field) over 64 KiB. The tensors exist meanwhile (a
checkpoint file and a KV cache over the bound are checked), so a route that put one back on Redis
fails here, naming the command.
"""

from __future__ import annotations

import asyncio
import io
import random
import re
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

import aiohttp
from redis.asyncio import Redis

from bubbletea.launcher.procs import front_door
from bubbletea.launcher.train import run_training
from shared.config.settings import load_settings
from shared.control import serving
from shared.wire.status import RequestStatus
from tests.e2e.serving import SPEC, service_env, submit, wait_for_first_bubble, write_spec

#: The largest argument any command may carry: a control message, a handle or a small key.
BOUND = 64 * 1024
#: An escaped argument of a MONITOR line: "..." with \\, \", \xHH and the like inside.
ARG = re.compile(r'"((?:[^"\\]|\\.)*)"')
ESCAPE = re.compile(r"\\x[0-9a-fA-F]{2}|\\.")


@dataclass
class Watch:
    commands: int = 0
    largest: int = 0
    largest_command: str = ""
    seen: dict[str, int] = field(default_factory=dict)  # command name -> count


async def monitor(url: str, watch: Watch, ready: asyncio.Event) -> None:
    """Every command sent to the Redis at `url`, until cancelled (raw RESP: MONITOR's lines)."""
    u = urlsplit(url)
    reader, writer = await asyncio.open_connection(u.hostname, u.port, limit=1 << 28)
    try:
        if u.password:
            writer.write(f"AUTH {u.password}\r\n".encode())
            assert (await reader.readline()).startswith(b"+OK")
        writer.write(b"MONITOR\r\n")
        await writer.drain()
        assert (await reader.readline()).startswith(b"+OK")
        ready.set()
        while line := await reader.readline():
            text = line[1:].rstrip(b"\r\n").decode("latin-1")
            _, _, command = text.partition("] ")
            args = ARG.findall(command)
            if not args:
                continue
            watch.commands += 1
            name = args[0].upper()
            watch.seen[name] = watch.seen.get(name, 0) + 1
            size = max(len(ESCAPE.sub("x", a)) for a in args)  # raw bytes: an escape is one byte
            if size > watch.largest:
                watch.largest, watch.largest_command = size, " ".join(a[:80] for a in args[:3])
    finally:
        writer.close()


async def test_no_command_sent_to_redis_carries_a_tensor(tmp_path: Path, redis_url: str) -> None:
    run = f"contents-{uuid.uuid4().hex[:6]}"
    training = {**SPEC["training"], "iterations": 6, "checkpoint_every": 1, "save_every": 2}
    path = write_spec(tmp_path, training=training)
    state = tmp_path / "state"
    settings = load_settings(path, env={"BUBBLETEA_RUN": run, "BUBBLETEA_STATE_DIR": str(state)})
    watch, ready = Watch(), asyncio.Event()
    watcher = asyncio.create_task(monitor(redis_url, watch, ready))
    await asyncio.wait_for(ready.wait(), 10)
    rng = random.Random(7)
    saved = tmp_path / "saved"
    try:
        async with front_door(service_env(redis_url, path, run), out=io.StringIO()) as door:
            assert door.url is not None
            async with aiohttp.ClientSession() as http:
                training_run = asyncio.create_task(
                    run_training(
                        settings, redis_url, out=io.StringIO(), progress=False, quiet=True, dispatcher=True, save=saved
                    )
                )
                await wait_for_first_bubble(redis_url, run)
                # 110-128 tokens: a KV cache of the 4-layer prefill model is 2 x 4 x T x 32 x 4 B > 110 KiB
                bodies = [{"prompt": [rng.randrange(256) for _ in range(rng.randint(110, 128))]} for _ in range(16)]
                ids = [await submit(http, door.url, b) for b in bodies]
                result = await asyncio.wait_for(training_run, 240)
            assert len(result.losses) == training["iterations"]
            r = Redis.from_url(redis_url, protocol=2)
            answers = [await serving.lookup(r, run, rid) for rid in ids]
            await r.aclose()
    finally:
        watcher.cancel()
        await asyncio.gather(watcher, return_exceptions=True)

    assert watch.commands > 1000, watch  # the monitor saw the run
    assert watch.largest <= BOUND, (
        f"a command carried a {watch.largest}-byte argument to Redis (over {BOUND}): {watch.largest_command}"
    )
    # ... while tensors over the bound existed: checkpoints (files, Redis holds their paths),
    # the save's hand-over (read and deleted by the launcher), KV caches (kept by the workers)
    assert watch.seen.get("HSET", 0) >= 4 * training["iterations"] - 4, watch.seen  # a checkpoint a slot an iteration
    checkpoints = list((state / run / "ckpt").rglob("*.safetensors"))
    assert checkpoints and max(p.stat().st_size for p in checkpoints) > BOUND
    assert (saved / "model.safetensors").exists() and not (state / run / "save").exists()
    done = [a.result for a in answers if a is not None and a.status is RequestStatus.DONE and a.result is not None]
    assert done, [a.status if a else None for a in answers]
    assert all(a.kv_holder and a.kv_bytes > BOUND for a in done), [(a.kv_holder, a.kv_bytes) for a in done]
