"""The prefill HTTP API over real HTTP against a real redis-server.

Answers are written with `shared.control.serving.answer`, the same call the serving plane makes, so the
front door's side of the contract is exercised for real.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from typing import Any

import msgspec
import pytest
from aiohttp.test_utils import TestClient, TestServer
from redis.asyncio import Redis

from services.prefill_queue.api import FAILURE_STATUS
from services.prefill_queue.app import create_app
from services.prefill_queue.state import READ_EVERY_S, SETTINGS
from shared.bus.connection import blocking_client
from shared.config.settings import Settings, load_settings
from shared.control import serving
from shared.wire import FIELD, PrefillRequest, PrefillResult, decode, keys
from shared.wire.status import FailureReason, RequestStatus


def IN_BUBBLES(tokens: int) -> dict[str, object]:  # the name reads as a constant in the expected bodies
    """The usage's word on where the prompts were computed: all of them in the bubbles."""
    return {"prompt_tokens_details": {"bubble_tokens": tokens, "decoder_tokens": 0}}


#: The front door's run: the stream its requests go to, the in-flight count they are counted in.
RUN = "api"
REQUESTS = keys.prefill_requests_stream(RUN)


def settings_for(url: str, **env: str) -> Settings:
    s = load_settings(env={"REDIS_URL": url, "BUBBLETEA_RUN": RUN, **env})
    prefill = msgspec.structs.replace(
        s.spec.prefill, max_queue_depth=3, max_prompt_tokens=64, request_timeout_s=60.0, max_body_bytes=4096
    )
    return Settings(**{**s.__dict__, "spec": msgspec.structs.replace(s.spec, prefill=prefill)})


@pytest.fixture
async def client(redis_url: str) -> AsyncIterator[TestClient]:
    async with TestClient(TestServer(create_app(settings_for(redis_url)))) as c:
        yield c


async def queued(redis: Redis, n: int) -> list[PrefillRequest]:
    rows: Any = await redis.xrange(REQUESTS)
    reqs = [decode(f[FIELD]) for _, f in rows]
    assert len(reqs) == n
    return [r for r in reqs if isinstance(r, PrefillRequest)]


def ok_result(req: PrefillRequest, token: int = 65) -> PrefillResult:
    return PrefillResult(
        id=req.id,
        status=RequestStatus.DONE,
        token=token,
        text=chr(token),
        logprob=-0.5,
        top=((token, -0.5), (66, -1.5)),
        prompt_tokens=len(req.tokens),
        kv_key=f"bt:kv:{req.id}",
        kv_bytes=1024,
        kv_expires_at=time.time() + 60,
        worker="r0s1",
        queue_ms=1.0,
        prefill_ms=2.0,
    )


async def test_completion_is_answered_in_the_openai_shape(client: TestClient, redis: Redis) -> None:
    call = asyncio.create_task(
        client.post(
            "/v1/completions",
            json={"model": "bubbletea-gpt", "prompt": "Hello", "max_tokens": 1, "logprobs": 1},
            headers={"X-Request-Id": "abc123"},
        )
    )

    reader = blocking_client(str(client.server.app[SETTINGS].redis_url))
    got: Any = await reader.xread({REQUESTS: "0"}, count=1, block=30_000)  # wait for it
    await reader.aclose()
    assert got, "the request never reached the stream"
    req = decode(got[0][1][0][1][FIELD])
    assert isinstance(req, PrefillRequest)
    assert req.tokens == tuple(b"Hello") and req.temperature == 1.0 and req.logprobs == 1
    assert await serving.answer(redis, RUN, ok_result(req), req.reply_to)
    resp = await asyncio.wait_for(call, 60)
    assert resp.status == 200 and resp.headers["X-Request-Id"] == "abc123"
    body = await resp.json()
    assert body["object"] == "text_completion" and body["model"] == "bubbletea-gpt"
    assert body["choices"][0]["text"] == "A" and body["choices"][0]["finish_reason"] == "length"
    assert body["choices"][0]["logprobs"]["token_logprobs"] == [-0.5]
    assert body["usage"] == {"prompt_tokens": 5, "completion_tokens": 1, "total_tokens": 6, **IN_BUBBLES(5)}
    assert body["kv_transfer_params"]["key"] == f"bt:kv:{req.id}" and body["kv_transfer_params"]["bytes"] == 1024
    assert await serving.inflight(redis, RUN) == 0
    text = await (await client.get("/metrics")).text()
    assert 'bubbletea:request_total{outcome="success"} 1.0' in text


async def test_native_submit_status_and_idempotency(client: TestClient, redis: Redis) -> None:
    r1 = await client.post("/v1/prefill", json={"prompt": [1, 2, 3]}, headers={"Idempotency-Key": "k1"})
    assert r1.status == 202
    rid = (await r1.json())["id"]
    assert r1.headers["Location"] == f"/v1/prefill/{rid}"
    r2 = await client.post("/v1/prefill", json={"prompt": [1, 2, 3]}, headers={"Idempotency-Key": "k1"})
    assert r2.status == 200 and (await r2.json())["id"] == rid  # same key, same request
    assert len(await queued(redis, 1)) == 1  # enqueued once
    assert (await (await client.get(f"/v1/prefill/{rid}")).json())["status"] == "queued"
    req = (await queued(redis, 1))[0]
    assert keys.hash_tag(req.reply_to) == RUN  # the front door's results stream is the run's: one slot
    assert await serving.answer(redis, RUN, ok_result(req, 66), req.reply_to)
    assert not await serving.answer(redis, RUN, ok_result(req, 67), req.reply_to)  # first answer wins
    got = await (await client.get(f"/v1/prefill/{rid}")).json()
    assert got["status"] == "done" and got["result"]["token"] == 66
    assert (await client.get("/v1/prefill/pf-nope")).status == 404
    # docs/api.md: an answer read by its client (this GET) goes within 2 minutes; idempotency keys
    # live an hour (the queued status goes with the answer)
    record = keys.prefill_request_key(RUN, rid)
    assert await redis.hkeys(record) == [keys.PREFILL_RESULT_FIELD.encode()]
    assert 0 < await redis.ttl(record) <= keys.PREFILL_READ_GRACE_S == 120
    assert 3_500 < await redis.ttl(keys.idempotency_key(RUN, "k1")) <= keys.PREFILL_RECORD_TTL_S == 3_600


async def test_an_answer_nobody_read_keeps_its_hour(client: TestClient, redis: Redis) -> None:
    """docs/api.md: an answer no client has read (an abandoned 202) keeps its record an hour."""
    rid = (await (await client.post("/v1/prefill", json={"prompt": [1, 2]})).json())["id"]
    req = (await queued(redis, 1))[0]
    assert await serving.answer(redis, RUN, ok_result(req, 5), req.reply_to)
    await asyncio.sleep(READ_EVERY_S * 1.5)  # a front door's marking round passes: nothing to mark
    assert 3_500 < await redis.ttl(keys.prefill_request_key(RUN, rid)) <= keys.PREFILL_RECORD_TTL_S


async def test_a_failed_answer_is_reported(client: TestClient, redis: Redis) -> None:
    rid = (await (await client.post("/v1/prefill", json={"prompt": "x"})).json())["id"]
    req = (await queued(redis, 1))[0]
    failed = PrefillResult(
        id=rid,
        status=RequestStatus.FAILED,
        reason=FailureReason.DEADLINE,
        error="deadline passed before a bubble ran it",
    )
    await serving.answer(redis, RUN, failed, req.reply_to)
    got = await (await client.get(f"/v1/prefill/{rid}")).json()
    assert got == {
        "id": rid,
        "status": "failed",
        "reason": "deadline",
        "error": "deadline passed before a bubble ran it",
    }


@pytest.mark.parametrize("reason", list(FailureReason))
async def test_a_failed_completion_answers_the_http_status_of_its_reason(
    client: TestClient, redis: Redis, reason: FailureReason
) -> None:
    call = asyncio.create_task(client.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 1}))
    got: Any = await redis.xread({REQUESTS: "0"}, count=1, block=30_000)  # wait for it
    req = decode(got[0][1][0][1][FIELD])
    assert isinstance(req, PrefillRequest)
    failed = PrefillResult(id=req.id, status=RequestStatus.FAILED, reason=reason, error=f"it failed: {reason}")
    assert await serving.answer(redis, RUN, failed, req.reply_to)
    resp = await asyncio.wait_for(call, 60)
    assert resp.status == FAILURE_STATUS[reason]
    # every failure is the server's (5xx) except a refusal for load: 429, with when to come back
    assert resp.status >= 500 or (reason is FailureReason.OVERLOADED and resp.status == 429)
    if resp.status in (429, 503):
        assert int(resp.headers["Retry-After"]) > 0
    assert (await resp.json())["error"]["message"] == f"the prefill failed: it failed: {reason}"


async def test_an_answer_delivered_to_its_waiting_client_goes_within_the_grace(
    client: TestClient, redis: Redis
) -> None:
    """docs/api.md: the front door marks an answer it handed to a waiting client as read: its record
    goes within `keys.PREFILL_READ_GRACE_S`, not the hour (what keeps Redis flat under load)."""
    call = asyncio.create_task(client.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 1}))
    got: Any = await redis.xread({REQUESTS: "0"}, count=1, block=30_000)
    req = decode(got[0][1][0][1][FIELD])
    assert isinstance(req, PrefillRequest)
    assert await serving.answer(redis, RUN, ok_result(req, 7), req.reply_to)
    assert (await asyncio.wait_for(call, 60)).status == 200
    record = keys.prefill_request_key(RUN, req.id)
    for _ in range(50):  # marked within READ_EVERY_S (one round trip for every answer since)
        if 0 < await redis.ttl(record) <= keys.PREFILL_READ_GRACE_S:
            break
        await asyncio.sleep(0.1)
    assert 0 < await redis.ttl(record) <= keys.PREFILL_READ_GRACE_S


async def test_queue_full_answers_429_with_retry_after(client: TestClient, redis: Redis) -> None:
    for _ in range(3):
        assert (await client.post("/v1/prefill", json={"prompt": "x"})).status == 202
    resp = await client.post("/v1/prefill", json={"prompt": "x"}, headers={"Idempotency-Key": "late"})
    assert resp.status == 429 and resp.headers["Retry-After"] == "1"
    assert "queue is full" in (await resp.json())["error"]["message"]
    assert len(await queued(redis, 3)) == 3  # the refused one was not enqueued...
    assert await redis.get(keys.idempotency_key(RUN, "late")) is None  # ...and its key can be used again


async def test_sync_request_times_out_explicitly_and_stays_queued(redis_url: str, redis: Redis) -> None:
    s = settings_for(redis_url)
    s = Settings(
        **{
            **s.__dict__,
            "spec": msgspec.structs.replace(
                s.spec, prefill=msgspec.structs.replace(s.spec.prefill, request_timeout_s=0.2)
            ),
        }
    )
    async with TestClient(TestServer(create_app(s))) as c:
        resp = await c.post("/v1/completions", json={"model": "bubbletea-gpt", "prompt": "x"})
        assert resp.status == 504
        message = (await resp.json())["error"]["message"]
        assert "still queued: GET /v1/prefill/cmpl-" in message
        rid = message.split("GET /v1/prefill/")[1]
        assert (await (await c.get(f"/v1/prefill/{rid}")).json())["status"] == "queued"


@pytest.mark.parametrize(
    ("path", "body", "status", "fragment"),
    [
        ("/v1/completions", b"{not json", 400, "not valid JSON"),
        ("/v1/completions", b'{"model": "bubbletea-gpt", "prompt": "x", "max_tokens": 8}', 400, "prefill only"),
        ("/v1/completions", b'{"model": "other", "prompt": "x"}', 404, "does not exist"),
        ("/v1/completions", b'{"model": "bubbletea-gpt", "prompt": [999]}', 400, "outside the vocabulary"),
        ("/v1/prefill", b'{"prompt": "' + b"y" * 65 + b'"}', 400, "at most 64"),
        ("/v1/prefill", b'{"prompt": "' + b"z" * 5000 + b'"}', 413, "larger than 4096 bytes"),
        ("/v1/prefill", b'"just a string"', 400, "must be a JSON object"),
    ],
)
async def test_bad_input_gets_a_clear_4xx_and_nothing_is_queued(
    client: TestClient, redis: Redis, path: str, body: bytes, status: int, fragment: str
) -> None:
    resp = await client.post(path, data=body, headers={"Content-Type": "application/json"})
    assert resp.status == status
    assert fragment in (await resp.json())["error"]["message"]
    assert await redis.xlen(REQUESTS) == 0


async def test_api_key(redis_url: str) -> None:
    async with TestClient(TestServer(create_app(settings_for(redis_url, BUBBLETEA_API_KEY="s3cret")))) as c:
        assert (await c.get("/v1/models")).status == 401
        assert (await c.get("/v1/models", headers={"Authorization": "Bearer wrong"})).status == 401
        ok = await c.get("/v1/models", headers={"Authorization": "Bearer s3cret"})
        assert ok.status == 200 and (await ok.json())["data"][0]["id"] == "bubbletea-gpt"
        assert (await c.get("/health")).status == 200  # operational endpoints stay open
        assert (await c.get("/metrics")).status == 200  # /metrics too, unless BUBBLETEA_METRICS_AUTH=on


async def test_metrics_behind_the_api_key(redis_url: str) -> None:
    env = {"BUBBLETEA_API_KEY": "s3cret", "BUBBLETEA_METRICS_AUTH": "on"}
    async with TestClient(TestServer(create_app(settings_for(redis_url, **env)))) as c:
        assert (await c.get("/metrics")).status == 401
        ok = await c.get("/metrics", headers={"Authorization": "Bearer s3cret"})
        assert ok.status == 200 and "bubbletea:" in await ok.text()
        assert (await c.get("/health")).status == 200


async def test_ready_needs_a_dispatcher_and_openapi_is_served(client: TestClient) -> None:
    resp = await client.get("/ready")
    assert resp.status == 503 and "no dispatcher" in (await resp.json())["reason"]
    spec = await (await client.get("/openapi.json")).json()
    assert spec["openapi"].startswith("3.") and {"/v1/completions", "/v1/prefill", "/v1/prefill/{id}"} <= set(
        spec["paths"]
    )


async def take_requests(redis: Redis, n: int, after: str = "0") -> list[PrefillRequest]:
    """Block until `n` requests are on the request stream after `after`; return them in order."""
    reqs: list[PrefillRequest] = []
    while len(reqs) < n:
        got: Any = await redis.xread({REQUESTS: after}, block=30_000)
        assert got, f"only {len(reqs)} of {n} requests reached the stream"
        for entry_id, f in got[0][1]:
            after = entry_id.decode()
            m = decode(f[FIELD])
            assert isinstance(m, PrefillRequest)
            reqs.append(m)
    return reqs


async def read_sse(resp: Any) -> tuple[list[dict[str, Any]], float | None, bool]:
    """The events of a server-sent stream as `vllm bench serve` reads them: JSON per `data:` line,
    the time of the first chunk whose first choice has text (its TTFT), and whether [DONE] came."""
    events: list[dict[str, Any]] = []
    first_text_at, done = None, False
    async for raw in resp.content:
        line = raw.decode().strip()
        if not line.startswith("data: "):
            continue
        data = line.removeprefix("data: ")
        if data == "[DONE]":
            done = True
            continue
        event = json.loads(data)
        events.append(event)
        if (choices := event.get("choices")) and choices[0].get("text") and first_text_at is None:
            first_text_at = time.perf_counter()
    return events, first_text_at, done


async def test_streaming_answers_as_vllm_bench_serve_reads_it(client: TestClient, redis: Redis) -> None:
    body = {
        "model": "bubbletea-gpt",
        "prompt": "Hello",
        "temperature": 0.0,
        "repetition_penalty": 1.0,
        "max_tokens": 1,
        "logprobs": None,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    t0 = time.perf_counter()
    call = asyncio.create_task(client.post("/v1/completions", json=body))
    (req,) = await take_requests(redis, 1)
    assert await serving.answer(redis, RUN, ok_result(req), req.reply_to)
    resp = await asyncio.wait_for(call, 60)
    assert resp.status == 200 and resp.headers["Content-Type"].startswith("text/event-stream")
    events, first_text_at, done = await read_sse(resp)
    assert done and first_text_at is not None and first_text_at > t0
    token, tail = events
    assert token["object"] == "text_completion" and token["choices"][0]["text"] == "A"
    assert token["choices"][0]["finish_reason"] == "length" and token["usage"] is None
    assert tail["choices"] == [] and tail["usage"] == {
        "prompt_tokens": 5,
        "completion_tokens": 1,
        "total_tokens": 6,
        **IN_BUBBLES(5),
    }


async def test_a_list_of_prompts_gets_one_choice_each_in_prompt_order(client: TestClient, redis: Redis) -> None:
    call = asyncio.create_task(client.post("/v1/completions", json={"prompt": ["ab", [1, 2, 3], "c"]}))
    reqs = await take_requests(redis, 3)
    assert [r.tokens for r in reqs] == [(97, 98), (1, 2, 3), (99,)]
    for req, token in reversed(list(zip(reqs, (65, 66, 67), strict=True))):  # answered out of order
        assert await serving.answer(redis, RUN, ok_result(req, token), req.reply_to)
    body = await (await asyncio.wait_for(call, 60)).json()
    assert [(c["index"], c["text"]) for c in body["choices"]] == [(0, "A"), (1, "B"), (2, "C")]
    assert body["usage"] == {"prompt_tokens": 6, "completion_tokens": 3, "total_tokens": 9, **IN_BUBBLES(6)}


async def test_a_streamed_list_sends_each_choice_as_it_is_answered(client: TestClient, redis: Redis) -> None:
    call = asyncio.create_task(client.post("/v1/completions", json={"prompt": ["ab", "cd"], "stream": True}))
    first, second = await take_requests(redis, 2)
    assert await serving.answer(redis, RUN, ok_result(second, 66), second.reply_to)  # the second lands first
    resp = await asyncio.wait_for(call, 60)
    assert await serving.answer(redis, RUN, ok_result(first, 65), first.reply_to)
    events, _, done = await read_sse(resp)
    assert done and [(e["choices"][0]["index"], e["choices"][0]["text"]) for e in events] == [(1, "B"), (0, "A")]
    assert all("usage" not in e for e in events)  # not asked for


async def test_a_stop_sequence_in_the_token_ends_the_choice_there(client: TestClient, redis: Redis) -> None:
    call = asyncio.create_task(client.post("/v1/completions", json={"prompt": "x", "stop": ["A"]}))
    (req,) = await take_requests(redis, 1)
    assert await serving.answer(redis, RUN, ok_result(req, 65), req.reply_to)
    (c,) = (await (await asyncio.wait_for(call, 60)).json())["choices"]
    assert (c["text"], c["finish_reason"], c["stop_reason"]) == ("", "stop", "A")


async def test_a_failure_before_the_stream_keeps_its_http_status(client: TestClient, redis: Redis) -> None:
    call = asyncio.create_task(client.post("/v1/completions", json={"prompt": "x", "stream": True}))
    (req,) = await take_requests(redis, 1)
    failed = PrefillResult(id=req.id, status=RequestStatus.FAILED, reason=FailureReason.DEADLINE, error="too late")
    assert await serving.answer(redis, RUN, failed, req.reply_to)
    resp = await asyncio.wait_for(call, 60)
    assert resp.status == 504 and (await resp.json())["error"]["message"] == "the prefill failed: too late"


async def test_x_request_id_names_the_completion_and_kv_params_follow_vllm(client: TestClient, redis: Redis) -> None:
    call = asyncio.create_task(client.post("/v1/completions", json={"prompt": "x"}, headers={"X-Request-Id": "abc-1"}))
    (req,) = await take_requests(redis, 1)
    assert await serving.answer(redis, RUN, ok_result(req), req.reply_to)
    resp = await asyncio.wait_for(call, 60)
    body = await resp.json()
    assert body["id"].startswith("cmpl-abc-1-") and resp.headers["X-Request-Id"] == "abc-1"
    kv = body["kv_transfer_params"]
    assert kv["do_remote_prefill"] is True and kv["do_remote_decode"] is False and kv["key"] == f"bt:kv:{req.id}"
    from services.prefill_queue.api import KV_HANDLE_FORMAT
    from shared.dataplane.kvstore import KV_FORMAT

    assert kv["format"] == KV_HANDLE_FORMAT == f"safetensors:{KV_FORMAT}"  # the handle names what the store holds
    bad = await client.post("/v1/completions", json={"prompt": "x"}, headers={"X-Request-Id": "no spaces"})
    assert bad.status == 400 and (await bad.json())["error"]["param"] == "X-Request-Id"


@pytest.mark.parametrize("stream", [False, True])
async def test_a_one_token_answer_says_the_front_doors_own_time_to_first_token(
    client: TestClient, redis: Redis, stream: bool
) -> None:
    from loadgen.stream import server_ttft_s

    sent = time.perf_counter()
    call = asyncio.create_task(client.post("/v1/completions", json={"prompt": "x", "stream": stream}))
    (req,) = await take_requests(redis, 1)
    await asyncio.sleep(0.2)  # the answer held back: the front door's own time is at least this
    assert await serving.answer(redis, RUN, ok_result(req), req.reply_to)
    resp = await asyncio.wait_for(call, 60)
    assert resp.status == 200
    await resp.read()
    own = server_ttft_s(resp.headers["Server-Timing"])
    assert own is not None and 0.2 <= own <= time.perf_counter() - sent


async def test_an_answers_way_back_through_redis_counts_in_the_front_doors_hops(
    client: TestClient, redis: Redis
) -> None:
    """The time from a worker's answer (`finished`) to its landing here is kept out of the next
    requests' objectives, with the front door's own hops (`FrontDoorHops`)."""
    from services.prefill_queue.state import HOPS

    assert client.server.app[HOPS].kept_s(10.0) == 0.0
    call = asyncio.create_task(client.post("/v1/completions", json={"prompt": "x", "stream": True}))
    (req,) = await take_requests(redis, 1)
    answered = msgspec.structs.replace(ok_result(req), finished=time.time() - 0.3)  # it left the worker 0.3 s ago
    assert await serving.answer(redis, RUN, answered, req.reply_to)
    resp = await asyncio.wait_for(call, 60)
    assert resp.status == 200
    await resp.read()
    assert 0.3 <= client.server.app[HOPS].kept_s(10.0) < 2.5


async def test_models_carry_what_vllm_clients_read(client: TestClient) -> None:
    (m,) = (await (await client.get("/v1/models")).json())["data"]
    assert m["id"] == m["root"] == "bubbletea-gpt" and m["owned_by"] == "bubbletea"
    assert m["max_model_len"] == min(m["max_model_len"], 256) > 0


async def test_vllm_request_metrics_count_what_was_answered(client: TestClient, redis: Redis) -> None:
    from prometheus_client.parser import text_string_to_metric_families

    call = asyncio.create_task(client.post("/v1/completions", json={"prompt": ["ab", "cde"], "stop": "B"}))
    first, second = await take_requests(redis, 2)
    assert await serving.answer(redis, RUN, ok_result(first, 65), first.reply_to)
    assert await serving.answer(redis, RUN, ok_result(second, 66), second.reply_to)  # "B": stopped
    assert (await asyncio.wait_for(call, 60)).status == 200
    text = await (await client.get("/metrics")).text()
    samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }
    model = ("model_name", "bubbletea-gpt")
    assert samples[("bubbletea:prompt_tokens_total", (model,))] == 5
    assert samples[("bubbletea:request_prompt_tokens_count", (model,))] == 2
    assert samples[("bubbletea:e2e_request_latency_seconds_count", (model,))] == 1
    assert samples[("bubbletea:request_success_total", (("finished_reason", "length"), model))] == 1
    assert samples[("bubbletea:request_success_total", (("finished_reason", "stop"), model))] == 1
    assert samples[("bubbletea:num_requests_running", (model,))] == 0
