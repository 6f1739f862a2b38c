"""Prefill served in the bubbles of a live training run: every answer is really computed.

Real processes (front door, dispatcher, WAN broker, four stage workers) over a real redis-server;
requests go in over real HTTP while the pipeline trains. Each answer (first token, logprob, top
alternatives) and each stored KV cache must equal what `PrefillModel.prefill` computes for the
same prompt in this process.
"""

from __future__ import annotations

import asyncio
import io
import random
import re
import uuid
from pathlib import Path

import aiohttp
import pytest
import torch
from redis.asyncio import Redis

from bubbletea.launcher.procs import front_door
from bubbletea.launcher.train import run_training
from shared.config.settings import load_settings
from shared.control.health import live_instances
from shared.dataplane import kvstore
from shared.dataplane.kv_client import KvClient
from shared.figures import runstats
from shared.model.prefill import PrefillModel
from shared.runtime import priority
from shared.runtime.redis_server import EmbeddedRedis
from shared.wire import SpanRecord, keys
from tests.e2e.serving import (
    SPEC,
    final_answers,
    service_env,
    submit,
    wait_for_first_bubble,
    wait_ready,
    wait_until,
    write_spec,
)


async def test_prompts_submitted_during_training_are_answered_with_computed_tokens(
    tmp_path: Path, redis_server: EmbeddedRedis
) -> None:
    # Training goes on until every request is final and the test stops it: on a busy machine the
    # submissions may take longer than any fixed number of iterations (a run that ended would fail
    # what still waits, which is tested in test_no_loss.py, not here).
    path = write_spec(tmp_path, training={**SPEC["training"], "iterations": 100_000})
    run = f"serve-{uuid.uuid4().hex[:6]}"
    settings = load_settings(path, env={"BUBBLETEA_RUN": run})
    env = service_env(redis_server.url, path, run)
    out = io.StringIO()
    rng = random.Random(5)
    prompts = [[rng.randrange(256) for _ in range(rng.randint(1, 128))] for _ in range(40)]
    bodies = [
        {"prompt": p, "logprobs": 3, **({"temperature": 0.8, "seed": i} if i % 3 == 0 else {})}
        for i, p in enumerate(prompts)
    ]
    async with front_door(env, out=out) as door, aiohttp.ClientSession() as http:
        assert door.url is not None
        training = asyncio.create_task(
            run_training(settings, redis_server.url, out=out, progress=False, dispatcher=True)
        )
        try:
            await wait_for_first_bubble(redis_server.url, run)  # training is under way
            await wait_ready(http, door.url)  # and the front door has heard so
            ids = []
            for body in bodies:
                ids.append(await submit(http, door.url, body))
                await asyncio.sleep(0.02)  # arrivals spread over the training run (load shape, not a wait)
            answers = await final_answers(http, door.url, ids, timeout=120)
            assert not training.done(), out.getvalue()[-3000:]  # it trained throughout, without failing
            # compute below the control plane: each worker's event loop at nice 0, its training
            # thread at TRAIN_NICE and its prefill thread at PREFILL_NICE (shared/runtime/priority.py).
            # The prefill thread starts at a worker's first block run off the loop: a worker whose
            # bubbles only ran first blocks (on the loop) has none yet (a CI run, 2026-11-28).
            workers = thread_nices(await worker_pids(redis_server.url, run))
            assert len(workers) == 4, workers
            for nices in workers.values():
                assert {0, priority.TRAIN_NICE} <= nices <= {0, priority.TRAIN_NICE, priority.PREFILL_NICE}, workers
            assert any(priority.PREFILL_NICE in nices for nices in workers.values()), workers
            # The KV caches stay in the workers (prefill.kv_store: plane): fetched over the data
            # plane ("host:port" of the worker's KV server) while the workers still run (they die
            # with them), one kept connection per worker.
            kvs, holders = {}, set()
            kv = KvClient()
            try:
                for rid, a in answers.items():
                    if a["status"] != "done":
                        continue
                    handle = a["result"]["kv_transfer_params"]
                    assert handle["store"] == "plane" and handle["key"] == rid and handle["bytes"] > 0, handle
                    data, why = await kv.fetch(handle["holder"], rid)
                    assert data is not None and len(data) == handle["bytes"], why
                    kvs[rid] = kvstore.read_kv_file(data)
                    holders.add(handle["holder"])
                assert kv.connects == len(holders) <= 4, holders
            finally:
                await kv.close()
        finally:
            training.cancel()
            await asyncio.gather(training, return_exceptions=True)
        async with http.get(f"{door.url}/metrics") as resp:
            metrics = await resp.text()
        ttft = re.search(r"^bubbletea:time_to_first_token_seconds_count (\S+)", metrics, re.M)
        ok = re.search(r'^bubbletea:request_total\{outcome="success"\} (\S+)', metrics, re.M)
        assert ttft and ok and float(ttft.group(1)) == float(ok.group(1)) == len(bodies), metrics

        # Readiness: the dispatcher is gone with the run, so the front door says it cannot serve.
        async def not_ready() -> bool:
            async with http.get(f"{door.url}/ready") as resp:
                return resp.status == 503

        await wait_until(not_ready, "/ready answering 503 once the run stopped")

    not_done = [(rid, a) for rid, a in answers.items() if a["status"] != "done"]
    assert not not_done, f"failed: {not_done[:3]}\n{out.getvalue()[-3000:]}"

    model = PrefillModel.from_spec(settings.spec.prefill)
    r = Redis.from_url(redis_server.url)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the workers run: the same reduction order, so bit-identical KV
    try:
        for rid, body in zip(ids, bodies, strict=True):
            answer = answers[rid]
            got = answer["result"]
            want = model.prefill(
                body["prompt"], temperature=body.get("temperature", 0.0), seed=body.get("seed"), top_logprobs=3
            )
            assert got["token"] == want.token
            assert got["logprob"] == pytest.approx(want.logprob, abs=1e-6)
            assert [t for t, _ in got["top_logprobs"]] == [t for t, _ in want.top]
            assert got["prompt_tokens"] == len(body["prompt"])
            assert got["worker"].startswith("r")
            stored = kvs[rid]
            assert len(stored.kv) == len(want.kv)
            assert stored.prompt == body["prompt"] and stored.first_token == want.token
            for (k, v), (wk, wv) in zip(stored.kv, want.kv, strict=True):
                assert torch.equal(k, wk) and torch.equal(v, wv)
        assert not await r.keys(keys.kv_cache_key(run, "*")), "a KV cache went through Redis"

        # Every prefill started inside one of its worker's bubbles. (How soon after the training
        # input it stopped is a timing figure, on a busy machine at the scheduler's mercy: the
        # benchmarks measure it, as prefill lag and training slowdown.)
        spans = [m for m in await runstats.read_stream(r, keys.spans_stream(run)) if isinstance(m, SpanRecord)]
        waits = [s for s in spans if s.span == "wait"]
        prefills = [s for s in spans if s.span == "prefill"]
        assert prefills
        for p in prefills:
            assert any((w.replica, w.stage) == (p.replica, p.stage) and w.start <= p.start <= w.end for w in waits), (
                f"prefill outside a bubble: {p}"
            )
    finally:
        torch.set_num_threads(threads)
        await r.aclose()


async def worker_pids(url: str, run: str) -> list[int]:
    """The run's stage-worker processes, from their heartbeats (a forked worker's /proc environment
    is its fork server's, so it cannot say which run the worker belongs to)."""
    r = Redis.from_url(url, protocol=2)
    try:
        return [inst["pid"] for inst in await live_instances(r, "stage_worker") if inst.get("run") == run]
    finally:
        await r.aclose()


def thread_nices(pids: list[int]) -> dict[int, set[int]]:
    """The nice values of every thread of each process, by pid (/proc)."""
    out: dict[int, set[int]] = {}
    for pid in pids:
        try:
            tasks = Path(f"/proc/{pid}/task").iterdir()
            out[pid] = {int((task / "stat").read_text().rsplit(")", 1)[1].split()[16]) for task in tasks}
        except OSError:  # a process that ended meanwhile
            continue
    return out
