"""KV caches are counted against `prefill.kv_budget_mb` in Redis: past it a finished prefill still
answers, but its KV cache is not stored and the handle says why (logged at most once a minute)."""

from __future__ import annotations

import logging

import pytest
import torch
from redis.asyncio import Redis

from services.prefill_queue.api import kv_params
from services.stage_worker.fill.batch import Outcome
from services.stage_worker.fill.reporting import Reporter
from services.stage_worker.port.stage_port import PrefillPort, StagePort
from shared.bus import Bus
from shared.control import serving
from shared.dataplane import kvstore
from shared.model.prefill import PrefillResult as ModelResult
from shared.wire import PrefillItem, PrefillResult, decode, keys


async def test_store_within_budget_counts_bytes_and_refuses_past_the_budget(redis: Redis) -> None:
    now = 1_700_000_000.0
    run = "kvb"
    first = await kvstore.store_kv_within_budget(redis, run, "a", b"x" * 600, 30, 1000, now)
    assert first.key == keys.kv_cache_key(run, "a") and first.used == 600
    second = await kvstore.store_kv_within_budget(redis, run, "b", b"y" * 600, 30, 1000, now + 1)
    assert second.key == "" and second.used == 600  # 1200 > 1000: not stored
    assert await redis.get(keys.kv_cache_key(run, "b")) is None
    assert await redis.get(keys.kv_cache_key(run, "a")) == b"x" * 600
    assert 0 < await redis.ttl(keys.kv_cache_key(run, "a")) <= 30
    # the budget is the run's (its keys share its hash tag): another run's caches do not count
    other = await kvstore.store_kv_within_budget(redis, "kvb-other", "b", b"y" * 600, 30, 1000, now + 1)
    assert other.key == keys.kv_cache_key("kvb-other", "b") and other.used == 600
    # once the first cache's TTL (and its bucket) is over, the budget is free again
    later = await kvstore.store_kv_within_budget(redis, run, "c", b"z" * 600, 30, 1000, now + 30 + 4)
    assert later.key and later.used == 600
    for key in await redis.keys(keys.kv_budget_bucket_key(run, 0).rsplit(":", 1)[0] + ":*"):
        assert 0 < await redis.ttl(key) <= 30 + 2 * 2  # every counter expires


def _tiny(prompt_tokens: int) -> ModelResult:
    kv = [(torch.zeros(1, 2, prompt_tokens, 4), torch.zeros(1, 2, prompt_tokens, 4)) for _ in range(2)]
    return ModelResult(token=5, text="x", logprob=-0.1, top=[], prompt_tokens=prompt_tokens, kv=kv)


async def test_past_the_budget_the_answer_comes_without_a_kv_cache_saying_why(
    redis_url: str, redis: Redis, caplog: pytest.LogCaptureFixture
) -> None:
    async with Bus(redis_url) as bus:
        size = len(kvstore.kv_file("r0", "m", range(16), 5, _tiny(16).kv))
        port = StagePort(PrefillPort(bus.redis, "run", kv_ttl_s=30, kv_budget_bytes=size * 3 // 2))  # one, not two
        reporter = Reporter(bus, "run", "r0s0", "m", port)
        with caplog.at_level(logging.WARNING, logger="services.stage_worker.fill.reporting"):
            for i in range(3):
                item = PrefillItem(id=f"r{i}", tokens=tuple(range(16)), from_layer=0, to_layer=2, reply_to="out")
                await reporter.answer([Outcome(item, 2, 0.01, result=_tiny(16))])
        answers = [decode(f[b"m"]) for _, f in await redis.xrange("out")]
    assert all(isinstance(a, PrefillResult) and a.ok for a in answers) and len(answers) == 3
    stored, *skipped = answers
    assert isinstance(stored, PrefillResult) and stored.kv_key == keys.kv_cache_key("run", "r0") and not stored.kv_note
    for a in skipped:
        assert isinstance(a, PrefillResult) and a.kv_key == "" and "budget" in a.kv_note
        handle = kv_params(a)
        assert handle["store"] == "none" and "prefill.kv_budget_mb" in handle["why"]
    assert await redis.get(keys.kv_cache_key("run", "r1")) is None
    budget_logs = [r for r in caplog.records if "budget full" in r.getMessage()]
    assert len(budget_logs) == 1  # two caches skipped, one line (at most one a minute)
    assert 0 < await redis.ttl("out") <= keys.PREFILL_RESULTS_TTL_S  # the results stream expires


async def test_with_kv_ttl_0_the_handle_says_nothing_is_stored(redis_url: str, redis: Redis) -> None:
    async with Bus(redis_url) as bus:
        reporter = Reporter(bus, "run", "r0s0", "m", StagePort(PrefillPort(bus.redis, "run", kv_ttl_s=0)))
        item = PrefillItem(id="z", tokens=(1, 2), from_layer=0, to_layer=2, reply_to="out")
        await reporter.answer([Outcome(item, 2, 0.01, result=_tiny(2))])
        [(_, f)] = await redis.xrange("out")
    a = decode(f[b"m"])
    assert isinstance(a, PrefillResult) and kv_params(a)["why"].startswith("prefill.kv_ttl_s is 0")
    assert serving.RESULTS_MAXLEN == keys.PREFILL_RESULTS_MAXLEN
