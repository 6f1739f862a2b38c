"""The load generator against the real prefill API over real HTTP, with a real redis-server.

No dispatcher runs here, so by itself the API answers nothing but errors: those tests check
that the load generator counts them by status code, exactly. For the success path a small
stand-in answers requests straight off the request stream with `shared.control.serving.answer`, the same
call the serving plane makes.

Where the timing of the stream itself is under test, a stand-in front door streams the events of
`services/prefill_queue/completions.py` (built by its own `choice` and `usage`) at chosen moments:
the time to first token must be the moment of the first chunk with a choice, not the response
headers nor the end of the stream. For a whole completion (max_tokens > 1) it streams more chunks,
of one or more tokens each, at chosen gaps: the inter-token latencies, the time per output token
and the end-to-end latency are checked against them.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterable, AsyncIterator, Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer
from redis.asyncio import Redis

import loadgen.client
from loadgen.cli import BenchmarkConfig, build_workload, run_benchmark
from loadgen.client import ApiUnavailable
from loadgen.report import format_summary
from services.prefill_queue.app import create_app
from services.prefill_queue.completions import choice, usage
from shared.bus.connection import blocking_client
from shared.config.settings import Settings, load_settings
from shared.control import serving, verdicts
from shared.wire import FIELD, PrefillRequest, PrefillResult, decode, keys
from shared.wire.status import FailureReason, RequestStatus

MAX_PROMPT = 64
#: The front door's run (its request stream, its in-flight count).
RUN = "r"


def settings_for(url: str, **prefill: Any) -> Settings:
    s = load_settings(env={"REDIS_URL": url, "BUBBLETEA_RUN": RUN})
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
    return [len(r.prompt) for r in build_workload(cfg).requests]


async def test_errors_are_counted_by_status_and_written_to_json(redis_url: str, tmp_path: Path) -> None:
    # Queue depth 3 and nobody answering: of the prompts the API accepts (<= 64 tokens) three are
    # queued and end in the server's 504 after 3 s, the rest are refused with 429; the prompts
    # over 64 tokens get 400. Which three are queued varies; the counts do not (the 3 s leave time
    # for all twelve, sent at once, to reach the server while the first three still wait).
    out = tmp_path / "result.json"
    async with api(redis_url, max_queue_depth=3, request_timeout_s=3.0) as url:
        cfg = config(url, num_prompts=12, input_len=50, range_ratio=0.5, seed=3, json_out=str(out))
        lengths = prompt_lengths(cfg)
        too_long = sum(n > MAX_PROMPT for n in lengths)
        assert 0 < too_long < 9  # the seed gives a mix
        result = await run_benchmark(cfg)

    assert result["completed"] == 0 and result["failed"] == 12
    assert result["error_counts"] == {"400": too_long, "429": 12 - too_long - 3, "504": 3}
    # one entry per request, in send order
    assert [e.startswith("HTTP 400: ") for e in result["errors"]] == [n > MAX_PROMPT for n in lengths]
    messages = {s["error"]: s["message"] for s in result["error_samples"]}
    assert f"at most {MAX_PROMPT}" in messages["400"]
    assert "queue is full" in messages["429"]
    assert "still queued" in messages["504"]
    assert result["ttfts_ms"] == [] and result["mean_ttft_ms"] is None and result["p99_ttft_ms"] is None
    assert result["ttfts"] == [0.0] * 12 and result["input_lens"] == lengths and result["output_lens"] == [0] * 12
    # how soon each failure came: the 400s and 429s at once, the 504s after their 3 s deadline
    after = list(zip(result["errors"], result["answered_after"], strict=True))
    assert all(s < 2.0 for e, s in after if e.startswith(("HTTP 400", "HTTP 429")))
    assert all(s >= 3.0 for e, s in after if e.startswith("HTTP 504"))
    assert result["model"] == "bubbletea-gpt" and result["endpoint"] == "completions"
    assert json.loads(out.read_text()) == json.loads(json.dumps(result))
    table = format_summary(result)
    assert "HTTP 400:" in table and "HTTP 429:" in table and "HTTP 504:" in table


async def test_native_requests_time_out_on_the_client(redis_url: str) -> None:
    # The server would wait 60 s; the client gives up after 3 s while polling "queued" (time for
    # the two over the queue's depth, sent at once, to get their 429 first).
    async with api(redis_url, max_queue_depth=3, request_timeout_s=60.0) as url:
        result = await run_benchmark(config(url, endpoint="native", num_prompts=5, input_len=8, timeout_s=3.0))
    assert result["error_counts"] == {"429": 2, "timeout": 3}
    assert result["completed"] == 0 and result["backend"] == "bubbletea"


@contextlib.asynccontextmanager
async def answering(redis_url: str, fails: Callable[[PrefillRequest], bool]) -> AsyncIterator[None]:
    """A stand-in for the serving plane: answers every request on the stream, as a failure when
    `fails(request)`."""
    reader = blocking_client(redis_url)
    writer = Redis.from_url(redis_url, protocol=2)

    async def loop() -> None:
        last = "0"
        while True:
            got: Any = await reader.xread({keys.prefill_requests_stream(RUN): last}, count=100, block=100)
            for _, rows in got or []:
                for msg_id, fields in rows:
                    last = msg_id
                    req = decode(fields[FIELD])
                    assert isinstance(req, PrefillRequest)
                    await serving.answer(writer, RUN, result_for(req, fails(req)), req.reply_to)

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


@pytest.mark.parametrize(
    ("endpoint", "stream", "failure"),
    [("completions", True, "500"), ("completions", False, "500"), ("native", True, "failed")],
)
async def test_answered_requests_are_measured(redis_url: str, endpoint: str, stream: bool, failure: str) -> None:
    def fails(req: PrefillRequest) -> bool:
        return req.tokens[0] % 4 == 0  # about a quarter, decided by the (seeded) prompt

    async with api(redis_url, max_queue_depth=100, request_timeout_s=60.0) as url, answering(redis_url, fails):
        cfg = config(
            url,
            endpoint=endpoint,
            stream=stream,
            num_prompts=20,
            request_rate=200.0,
            input_len=16,
            range_ratio=0.5,
            max_concurrency=8,
            goodput={"ttft": 60_000.0},
            percentile_metrics=["ttft", "e2el"],
        )
        sent = [r.prompt for r in build_workload(cfg).requests]
        result = await run_benchmark(cfg)

    bad = [p for p in sent if p[0] % 4 == 0]
    good = [p for p in sent if p[0] % 4 != 0]
    assert bad and good  # the seed gives a mix
    # (native polling once saw 404s here: lookup read two keys non-atomically; it uses MGET now)
    assert result["error_counts"] == {failure: len(bad)}, result["error_samples"]
    assert [e == "" for e in result["errors"]] == [p[0] % 4 != 0 for p in sent]
    assert result["completed"] == len(good) and result["failed"] == len(bad)
    assert result["total_input_tokens"] == sum(len(p) for p in good)
    assert all("boom" in s["message"] for s in result["error_samples"] if s["error"] == failure)
    assert len(result["ttfts_ms"]) == result["completed"] and all(t > 0 for t in result["ttfts_ms"])
    assert result["total_output_tokens"] == len(good)  # one token per prefill
    assert result["input_lens"] == [len(p) for p in sent]  # as the server counted them, or as sent
    assert result["request_goodput"] == pytest.approx(result["request_throughput"])  # a generous objective
    assert result["p99_e2el_ms"] == pytest.approx(result["p99_ttft_ms"])
    assert await _inflight(redis_url) == 0  # every request was answered: none is left behind


async def _inflight(redis_url: str) -> int:
    r = Redis.from_url(redis_url, protocol=2)
    try:
        return await serving.inflight(r, RUN)
    finally:
        await r.aclose()


# --- a stand-in front door that streams at chosen moments --------------------------------------


@dataclass
class FrontDoor:
    """Streams /v1/completions as services/prefill_queue/completions.py does, with `first_token_s`
    between the response headers and the first chunk and `tail_s` before the usage chunk and
    `[DONE]`. `more` decodes: after the first chunk, one more per (gap in seconds, tokens in it),
    the last with the finish reason; `usage_chunk` False leaves out the usage chunk (so the client
    must count the tokens itself). `mode` breaks the stream on purpose: "error" sends an error event
    instead of the token, "cut" ends the body without `[DONE]`. /v1/models answers 503
    `models_unavailable` times first. With `first_read` (see `reading_gate`) the rest of the stream
    waits until the client has read the first chunk. `sent` records, per request, when it arrived
    and when each chunk with a choice was sent (time.perf_counter, the client's clock)."""

    first_token_s: float = 0.0
    tail_s: float = 0.0
    more: list[tuple[float, int]] = field(default_factory=list)
    usage_chunk: bool = True
    mode: str = "ok"
    models_unavailable: int = 0
    model_calls: int = 0
    bodies: list[dict[str, Any]] = field(default_factory=list)
    headers: list[dict[str, str]] = field(default_factory=list)
    first_read: asyncio.Event | None = None
    sent: list[list[float]] = field(default_factory=list)

    async def models(self, request: web.Request) -> web.Response:
        self.model_calls += 1
        if self.model_calls <= self.models_unavailable:
            return web.json_response({"error": {"message": "starting", "code": 503}}, status=503)
        return web.json_response({"object": "list", "data": [{"id": "bubbletea-gpt", "root": "bubbletea-gpt"}]})

    async def completions(self, request: web.Request) -> web.StreamResponse:
        times = [time.perf_counter()]
        self.sent.append(times)
        body = await request.json()
        self.bodies.append(body)
        self.headers.append(dict(request.headers))
        req = PrefillRequest(
            id="cmpl-1", model="bubbletea-gpt", tokens=tuple(body["prompt"]), submitted=time.time(), reply_to="-"
        )
        answer = PrefillResult(id=req.id, status=RequestStatus.DONE, token=65, text="A", prompt_tokens=len(req.tokens))
        head = {"id": req.id, "object": "text_completion", "created": int(req.submitted), "model": req.model}
        tokens = 1 + sum(n for _, n in self.more)
        counted = {**usage([answer]), "completion_tokens": tokens, "total_tokens": len(req.tokens) + tokens}
        first = choice(0, req, answer, ())
        if not body.get("stream"):
            whole = {**first, "text": "A" + "".join("B" * n for _, n in self.more)}
            return web.json_response({**head, "choices": [whole], "usage": counted})
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await resp.prepare(request)

        async def send(event: dict[str, Any]) -> None:
            if event.get("choices"):
                times.append(time.perf_counter())  # before the write: the client reads it later
            await resp.write(f"data: {json.dumps(event)}\n\n".encode())

        def piece(text: str, last: bool) -> dict[str, Any]:
            finish = {} if last else {"finish_reason": None, "stop_reason": None}
            return {**head, "choices": [{**first, "text": text, **finish}], "usage": None}

        await asyncio.sleep(self.first_token_s)
        if self.mode == "error":
            await send({"error": {"message": "the prefill failed: boom", "code": 503}})
        else:
            await send(piece("A", not self.more))
            if self.first_read is not None:
                await asyncio.wait_for(self.first_read.wait(), 60)
                self.first_read.clear()
            for i, (gap_s, n) in enumerate(self.more):
                await asyncio.sleep(gap_s)
                await send(piece("B" * n, i == len(self.more) - 1))
        await asyncio.sleep(self.tail_s)
        if self.mode != "cut":
            if self.usage_chunk:
                await send({**head, "choices": [], "usage": counted if self.mode == "ok" else usage([])})
            await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp


@contextlib.asynccontextmanager
async def front_door(door: FrontDoor) -> AsyncIterator[str]:
    app = web.Application()
    app.router.add_get("/v1/models", door.models)
    app.router.add_post("/v1/completions", door.completions)
    async with TestServer(app) as server:
        yield str(server.make_url("")).rstrip("/")


def reading_gate(monkeypatch: pytest.MonkeyPatch, door: FrontDoor) -> None:
    """Sets `door.first_read` once the load generator has taken a stream's first event and asks for
    the next: the door sends the rest only then, so the client saw the first chunk before any
    later byte was even sent, however the host schedules the two."""
    door.first_read = asyncio.Event()
    real = loadgen.client.sse_data

    async def sse_data(lines: AsyncIterable[bytes]) -> AsyncIterator[str]:
        first = True
        async for data in real(lines):
            yield data  # returns when the client has fed the event to its tally and reads on
            if first and door.first_read is not None:
                door.first_read.set()
            first = False

    monkeypatch.setattr(loadgen.client, "sse_data", sse_data)


async def test_the_ttft_is_the_first_chunk_with_a_choice(monkeypatch: pytest.MonkeyPatch) -> None:
    door = FrontDoor(first_token_s=0.2, tail_s=1.0)
    reading_gate(monkeypatch, door)
    async with front_door(door) as url:
        result = await run_benchmark(config(url, num_prompts=2, input_len=8, max_concurrency=1))
    assert door.bodies[0]["stream"] is True and door.bodies[0]["stream_options"] == {"include_usage": True}
    assert door.bodies[0]["max_tokens"] == 1 and door.bodies[0]["model"] == "bubbletea-gpt"
    assert result["completed"] == 2 and result["errors"] == ["", ""]
    # Not the headers (0 s): the first chunk came 0.2 s after the request, so no sooner (causality).
    assert all(t >= 0.2 for t in result["ttfts"]), result["ttfts"]
    # Nor [DONE]: that was sent 1 s after the client had read the first chunk, and the requests
    # ran one after the other, so the run lasted each TTFT and each 1 s tail at least.
    assert result["duration"] >= sum(result["ttfts"]) + 2 * door.tail_s, (result["duration"], result["ttfts"])
    assert result["output_lens"] == [1, 1] and result["input_lens"] == [8, 8]  # from the usage chunk
    # One token: no inter-token latency nor time per output token, and no section for them.
    assert result["itls"] == [[], []] and result["mean_itl_ms"] is None and result["mean_tpot_ms"] is None
    assert "TPOT" not in format_summary(result) and "ITL" not in format_summary(result)


def decoding(usage_chunk: bool = True) -> FrontDoor:
    """A stand-in that decodes: after the first token at 0.1 s, chunks of 1, 2 and 1 tokens 0.05,
    0.1 and 0.15 s apart (the last at 0.4 s), then 0.2 s before the usage chunk and [DONE]."""
    return FrontDoor(first_token_s=0.1, more=[(0.05, 1), (0.1, 2), (0.15, 1)], tail_s=0.2, usage_chunk=usage_chunk)


def assert_no_earlier_than_sent(door: FrontDoor, result: dict[str, Any]) -> None:
    """Causality, request by request: the client saw its first token no sooner after sending than
    the door sent it after receiving, and its last token likewise (how much later is the host's
    scheduling). The gaps between tokens have no such bound: two chunks may be read together."""
    for times, ttft, itls in zip(door.sent, result["ttfts"], result["itls"], strict=True):
        received, *chunks = times
        assert ttft >= chunks[0] - received
        assert ttft + sum(itls) >= chunks[-1] - received


async def test_a_streamed_completion_is_timed_as_vllm_does() -> None:
    door = decoding()
    async with front_door(door) as url:
        cfg = config(url, num_prompts=2, input_len=8, max_concurrency=1, output_len=5)
        result = await run_benchmark(replace(cfg, percentile_metrics=["ttft", "tpot", "itl", "e2el"]))
    assert [b["max_tokens"] for b in door.bodies] == [5, 5] and "ignore_eos" not in door.bodies[0]
    assert result["completed"] == 2 and result["output_lens"] == [5, 5]  # usage.completion_tokens
    assert result["total_output_tokens"] == 10
    assert result["output_throughput"] == pytest.approx(10 / result["duration"])
    assert result["total_token_throughput"] == pytest.approx(26 / result["duration"])
    # The first token at 0.1 s and the last at 0.4 s after the request, at the soonest.
    assert all(t >= 0.1 for t in result["ttfts"]), result["ttfts"]
    assert_no_earlier_than_sent(door, result)
    # One ITL per chunk with a choice after the first, whatever it carries (vLLM's count).
    assert [len(itls) for itls in result["itls"]] == [3, 3]
    # The end-to-end latency runs to the last chunk with a choice, not to [DONE] (0.2 s later):
    # e2el = ttft + the ITLs, and TPOT, (e2el - ttft) / (5 - 1), their sum over 4 tokens, exactly.
    e2els_ms = [(ttft + sum(itls)) * 1000 for ttft, itls in zip(result["ttfts"], result["itls"], strict=True)]
    tpots_ms = [sum(itls) / 4 * 1000 for itls in result["itls"]]
    assert min(e2els_ms) >= 400
    assert result["mean_e2el_ms"] == pytest.approx(np.mean(e2els_ms), rel=1e-9)
    assert result["mean_tpot_ms"] == pytest.approx(np.mean(tpots_ms), rel=1e-9)
    assert result["p99_tpot_ms"] == pytest.approx(np.percentile(tpots_ms, 99), rel=1e-9)
    # The ITL statistics pool every gap of every request (vLLM's).
    gaps_ms = [gap * 1000 for itls in result["itls"] for gap in itls]
    assert result["mean_itl_ms"] == pytest.approx(np.mean(gaps_ms), rel=1e-9)
    assert result["median_itl_ms"] == pytest.approx(np.median(gaps_ms), rel=1e-9)
    assert result["p99_itl_ms"] == pytest.approx(np.percentile(gaps_ms, 99), rel=1e-9)
    table = format_summary(result)
    assert "Time per Output Token (excl. 1st token)" in table and "Inter-token Latency" in table


async def test_without_a_usage_chunk_the_chunks_are_counted() -> None:
    door = decoding(usage_chunk=False)
    async with front_door(door) as url:
        result = await run_benchmark(config(url, num_prompts=1, input_len=8, output_len=5))
    assert result["output_lens"] == [4] and result["input_lens"] == [8]  # 4 chunks with a choice, as sent
    ((ttft, itls),) = zip(result["ttfts"], result["itls"], strict=True)
    assert len(itls) == 3 and ttft + sum(itls) >= 0.4  # the last chunk at 0.4 s, at the soonest
    assert result["mean_tpot_ms"] == pytest.approx(sum(itls) / 3 * 1000, rel=1e-9)  # over 4 - 1 tokens


async def test_a_completion_not_streamed_has_no_itl_nor_tpot() -> None:
    door = decoding()
    async with front_door(door) as url:
        cfg = config(url, num_prompts=2, input_len=8, output_len=5, stream=False, percentile_metrics=["ttft", "e2el"])
        result = await run_benchmark(cfg)
    assert [b["max_tokens"] for b in door.bodies] == [5, 5] and "stream" not in door.bodies[0]
    assert result["output_lens"] == [5, 5] and result["itls"] == [[], []]  # usage.completion_tokens
    assert result["mean_itl_ms"] is None and result["mean_tpot_ms"] is None  # the token times are not seen
    assert result["mean_e2el_ms"] == pytest.approx(result["mean_ttft_ms"])  # the whole answer


async def test_random_output_len_asks_for_max_tokens_in_vllms_range() -> None:
    door = FrontDoor()
    async with front_door(door) as url:
        cfg = config(url, num_prompts=40, input_len=8, output_len=10, range_ratio=0.5, max_concurrency=1)
        planned = [r.max_tokens for r in build_workload(cfg).requests]
        result = await run_benchmark(cfg)
    sent = [b["max_tokens"] for b in door.bodies]
    assert sent == planned and min(sent) >= 5 and max(sent) <= 15 and len(set(sent)) > 3
    assert result["completed"] == 40 and result["output_len"] == 10


async def test_a_trace_asks_for_its_generated_tokens_clamped(tmp_path: Path) -> None:
    trace = tmp_path / "trace.csv"
    rows = ["TIMESTAMP,ContextTokens,GeneratedTokens"]
    rows += [f"2023-11-16 18:17:0{i}.0000000,{8 + i},{g}" for i, g in enumerate([10, 3, 0, 500])]
    trace.write_text("\n".join(rows) + "\n")
    door = FrontDoor()
    async with front_door(door) as url:
        cfg = config(url, dataset="trace", trace=str(trace), time_scale=100.0, max_concurrency=1)
        await run_benchmark(replace(cfg, max_output_len=64))
        decoded = [b["max_tokens"] for b in door.bodies]
        door.bodies.clear()
        await run_benchmark(cfg)  # --max-output-len 1, the default: prefill only
    assert decoded == [10, 3, 1, 64]  # a recorded 0 asks for 1; 500 is clamped
    assert [b["max_tokens"] for b in door.bodies] == [1, 1, 1, 1]


@pytest.mark.parametrize(
    ("mode", "kind", "message"),
    [("error", "503", "HTTP 503: the prefill failed: boom"), ("cut", "client_error", "client_error: the event")],
)
async def test_a_broken_stream_is_a_failure(mode: str, kind: str, message: str) -> None:
    async with front_door(FrontDoor(mode=mode)) as url:
        result = await run_benchmark(config(url, num_prompts=3, input_len=8))
    assert result["completed"] == 0 and result["error_counts"] == {kind: 3}
    assert all(e.startswith(message) for e in result["errors"]), result["errors"]
    assert result["ttfts"] == [0.0] * 3


async def test_no_stream_reads_one_json_answer() -> None:
    door = FrontDoor()
    async with front_door(door) as url:
        result = await run_benchmark(config(url, num_prompts=2, input_len=8, stream=False))
    assert "stream" not in door.bodies[0] and result["completed"] == 2 and result["stream"] is False


async def test_ready_check_warmups_headers_and_saved_results(tmp_path: Path) -> None:
    door = FrontDoor(models_unavailable=2)
    async with front_door(door) as url:
        with pytest.raises(ApiUnavailable, match="HTTP 503"):
            await run_benchmark(config(url, num_prompts=1))  # 0: one check, as before
        cfg = config(
            url,
            num_prompts=4,
            input_len=8,
            ready_check_timeout_s=30.0,
            num_warmups=3,
            headers={"x-run": "7", "Authorization": "Bearer from-header"},
            api_key="from-key",
            save_result=True,
            result_dir=str(tmp_path / "results"),
            metadata={"version": "0.3.3"},
            label="nightly",
        )
        result = await run_benchmark(cfg)
    assert door.model_calls == 3  # the first refused, then retried until it answered
    assert len(door.bodies) == 3 + 4 and result["completed"] == 4 and len(result["ttfts"]) == 4  # warmups not counted
    assert all(h["x-run"] == "7" and h["Authorization"] == "Bearer from-header" for h in door.headers)
    assert door.bodies[0] == door.bodies[1] == door.bodies[2] == door.bodies[3]  # warmups send the first prompt
    [saved] = (tmp_path / "results").iterdir()
    assert saved.name == f"nightly-infqps-bubbletea-gpt-{result['date']}.json"
    written = json.loads(saved.read_text())
    assert written == json.loads(json.dumps(result))
    assert written["version"] == "0.3.3" and written["label"] == "nightly"
    assert "from-header" not in saved.read_text() and "from-key" not in saved.read_text()  # never recorded


async def test_the_ready_check_waits_for_serving_and_says_why_it_gave_up(redis_url: str, redis: Redis) -> None:
    """BubbleTea serves only while training runs: with a wait, loadgen also waits for /ready."""
    from shared.wire.status import ServingState

    verdict = verdicts.Readiness(
        instance="dispatcher-test",
        run=RUN,
        state=ServingState.STARTING,
        reason="training of run r has not started: 0 of 4 slots held by workers",
        retry_after_s=2,
        at=time.time(),
    )
    await verdicts.publish_readiness(redis, verdict)
    async with api(redis_url) as url:
        with pytest.raises(ApiUnavailable, match="not ready to serve: training of run r has not started"):
            await run_benchmark(config(url, num_prompts=1, ready_check_timeout_s=2.0))
        await verdicts.withdraw_readiness(redis, RUN, "dispatcher-test")


async def test_ready_state_serving_waits_past_joining(redis_url: str, redis: Redis) -> None:
    """`--ready-state serving`: /ready answers 200 while the workers set up (joining), but the load
    starts only once training runs: here it gives up saying so, then starts once serving."""
    from shared.wire.status import ServingState

    def verdict(state: ServingState) -> verdicts.Readiness:
        return verdicts.Readiness(
            instance="dispatcher-test", run=RUN, state=state, reason=f"run r is {state.value}", retry_after_s=1,
            at=time.time(),
        )  # fmt: skip

    await verdicts.publish_readiness(redis, verdict(ServingState.JOINING))
    async with api(redis_url) as url:
        client_config = config(url, num_prompts=1, ready_check_timeout_s=1.0, ready_state="serving")
        with pytest.raises(ApiUnavailable, match="not ready to serve: run r is joining"):
            await run_benchmark(client_config)
        await verdicts.publish_readiness(redis, verdict(ServingState.SERVING))
        result = await run_benchmark(client_config)
        await verdicts.withdraw_readiness(redis, RUN, "dispatcher-test")
    assert result["completed"] + result["failed"] == 1  # it started: the request was sent
