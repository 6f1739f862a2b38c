"""The load generator against the real prefill API over real HTTP, with a real redis-server.

No dispatcher runs here, so by itself the API answers nothing but errors: those tests check
that the load generator counts them by status code, exactly. For the success path a small
stand-in answers requests straight off the request stream with `shared.serving.answer`, the same
call the serving plane makes.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import msgspec
import pytest
from aiohttp.test_utils import TestServer
from redis.asyncio import Redis

from loadgen.cli import BenchmarkConfig, build_workload, run_benchmark
from loadgen.report import format_summary
from services.prefill_queue.app import create_app
from shared import keys, serving
from shared.bus.connection import blocking_client
from shared.settings import Settings, load_settings
from shared.status import FailureReason, RequestStatus
from shared.wire import FIELD, PrefillRequest, PrefillResult, decode

pytestmark = pytest.mark.integration

MAX_PROMPT = 64


def settings_for(url: str, **prefill: Any) -> Settings:
    s = load_settings(env={"REDIS_URL": url})
    limits = {"max_prompt_tokens": MAX_PROMPT, "max_body_bytes": 65536, **prefill}
    spec = msgspec.structs.replace(s.spec, prefill=msgspec.structs.replace(s.spec.prefill, **limits))
    return Settings(**{**s.__dict__, "spec": spec})


@contextlib.asynccontextmanager
async def api(redis_url: str, **prefill: Any) -> AsyncIterator[str]:
    """The real prefill_queue app on a free local port; yields its base URL."""
    async with TestServer(create_app(settings_for(redis_url, **prefill))) as server:
        yield str(server.make_url("")).rstrip("/")


def config(base_url: str, **overrides: Any) -> BenchmarkConfig:
    return BenchmarkConfig(base_url=base_url, disable_tqdm=True, **overrides)


def prompt_lengths(cfg: BenchmarkConfig) -> list[int]:
    """The lengths the run will send: the workload is deterministic for a config."""
    return [len(prompt) for _, prompt in build_workload(cfg).requests]


async def test_errors_are_counted_by_status_and_written_to_json(redis_url: str, tmp_path: Path) -> None:
    # Queue depth 3 and nobody answering: of the prompts the API accepts (<= 64 tokens) three are
    # queued and end in the server's 504 after 0.3 s, the rest are refused with 429; the prompts
    # over 64 tokens get 400. Which three are queued varies; the counts do not.
    out = tmp_path / "result.json"
    async with api(redis_url, max_queue_depth=3, request_timeout_s=0.3) as url:
        cfg = config(url, num_prompts=12, input_len=50, range_ratio=0.5, seed=3, json_out=str(out))
        lengths = prompt_lengths(cfg)
        too_long = sum(n > MAX_PROMPT for n in lengths)
        assert 0 < too_long < 9  # the seed gives a mix
        result = await run_benchmark(cfg)

    assert result["completed"] == 0 and result["failed"] == 12
    assert result["errors"] == {"400": too_long, "429": 12 - too_long - 3, "504": 3}
    messages = {s["error"]: s["message"] for s in result["error_samples"]}
    assert f"at most {MAX_PROMPT}" in messages["400"]
    assert "queue is full" in messages["429"]
    assert "still queued" in messages["504"]
    assert result["ttfts_ms"] == [] and result["mean_ttft_ms"] is None and result["p99_ttft_ms"] is None
    assert result["model"] == "bubbletea-gpt" and result["endpoint"] == "completions"
    assert json.loads(out.read_text()) == json.loads(json.dumps(result))
    table = format_summary(result)
    assert "HTTP 400:" in table and "HTTP 429:" in table and "HTTP 504:" in table


async def test_native_requests_time_out_on_the_client(redis_url: str) -> None:
    # The server would wait 30 s; the client gives up after 0.3 s while polling "queued".
    async with api(redis_url, max_queue_depth=3, request_timeout_s=30.0) as url:
        result = await run_benchmark(config(url, endpoint="native", num_prompts=5, input_len=8, timeout_s=0.3))
    assert result["errors"] == {"429": 2, "timeout": 3}
    assert result["completed"] == 0


@contextlib.asynccontextmanager
async def answering(redis_url: str, fails: Callable[[PrefillRequest], bool]) -> AsyncIterator[None]:
    """A stand-in for the serving plane: answers every request on the stream, as a failure when
    `fails(request)`."""
    reader = blocking_client(redis_url)
    writer = Redis.from_url(redis_url, protocol=2)

    async def loop() -> None:
        last = "0"
        while True:
            got: Any = await reader.xread({keys.PREFILL_REQUESTS_STREAM: last}, count=100, block=100)
            for _, rows in got or []:
                for msg_id, fields in rows:
                    last = msg_id
                    req = decode(fields[FIELD])
                    assert isinstance(req, PrefillRequest)
                    await serving.answer(writer, result_for(req, fails(req)), req.reply_to)

    task = asyncio.create_task(loop())
    try:
        yield
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        await reader.aclose()
        await writer.aclose()


def result_for(req: PrefillRequest, failed: bool) -> PrefillResult:
    if failed:
        return PrefillResult(
            id=req.id,
            status=RequestStatus.FAILED,
            reason=FailureReason.MODEL_REFUSED,
            error="boom: the stand-in refused it",
        )
    return PrefillResult(
        id=req.id,
        status=RequestStatus.DONE,
        token=65,
        text="A",
        prompt_tokens=len(req.tokens),
        kv_key=f"bt:kv:{req.id}",
        kv_expires_at=time.time() + 60,
    )


@pytest.mark.parametrize(("endpoint", "failure"), [("completions", "500"), ("native", "failed")])
async def test_answered_requests_are_measured(redis_url: str, endpoint: str, failure: str) -> None:
    def fails(req: PrefillRequest) -> bool:
        return req.tokens[0] % 4 == 0  # about a quarter, decided by the (seeded) prompt

    async with api(redis_url, max_queue_depth=100, request_timeout_s=10.0) as url, answering(redis_url, fails):
        cfg = config(
            url,
            endpoint=endpoint,
            num_prompts=20,
            request_rate=200.0,
            input_len=16,
            range_ratio=0.5,
            max_concurrency=8,
            goodput={"ttft": 60_000.0},
            percentile_metrics=["ttft", "e2el"],
        )
        sent = [prompt for _, prompt in build_workload(cfg).requests]
        result = await run_benchmark(cfg)

    bad = [p for p in sent if p[0] % 4 == 0]
    good = [p for p in sent if p[0] % 4 != 0]
    assert bad and good  # the seed gives a mix
    errors = dict(result["errors"])
    # (native polling once saw 404s here: lookup read two keys non-atomically; it uses MGET now)
    assert errors == {failure: len(bad)}, result["error_samples"]
    assert result["completed"] == len(good) and result["failed"] == len(bad)
    assert result["total_input_tokens"] == sum(len(p) for p in good)
    assert all("boom" in s["message"] for s in result["error_samples"] if s["error"] == failure)
    assert len(result["ttfts_ms"]) == result["completed"] and all(t > 0 for t in result["ttfts_ms"])
    assert result["goodput"] == pytest.approx(result["request_throughput"])  # a generous objective
    assert result["p99_e2el_ms"] == pytest.approx(result["p99_ttft_ms"])
    assert await _inflight(redis_url) == 0  # every request was answered: none is left behind


async def _inflight(redis_url: str) -> int:
    r = Redis.from_url(redis_url, protocol=2)
    try:
        return await serving.inflight(r)
    finally:
        await r.aclose()
