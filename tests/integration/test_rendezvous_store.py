"""The data plane's rendezvous store (shared/dataplane/store.py) waits without polling: a waiter
blocks on the key's wake list and is woken by the `set`, a key set before the wait is seen at once,
every waiter of a key wakes, and a wait that is called off or runs out ends. Counted on the server
(INFO commandstats): a wait of a second sends a handful of commands, not the ~500 EXISTS a 2 ms
poll sent. Runs on a cluster too (``BUBBLETEA_TEST_REDIS=cluster``; the prefix carries the run's
hash tag, as shared/wire/keys.py builds it)."""

from __future__ import annotations

import asyncio
import threading
import time
from datetime import timedelta
from typing import Any

import pytest
from redis.asyncio import Redis, RedisCluster

from shared.dataplane.store import WAKE_S, RedisStore, wake_list

PREFIX = "bt:{t}:plane:1:pair:"


async def exists_calls(r: Redis) -> int:
    """EXISTS commands the server (every master of a cluster) has run so far."""
    if isinstance(r, RedisCluster):
        per_node: Any = await r.info("commandstats", target_nodes=RedisCluster.PRIMARIES)
        stats = list(per_node.values())
    else:
        stats = [await r.info("commandstats")]
    return sum(int(s.get("cmdstat_exists", {}).get("calls", 0)) for s in stats)


async def test_a_wait_is_woken_by_the_set_without_polling(redis_url: str, redis: Redis) -> None:
    waiter, writer = RedisStore(redis_url, PREFIX, timeout_s=30), RedisStore(redis_url, PREFIX, timeout_s=30)
    try:
        before = await exists_calls(redis)
        waiting = asyncio.create_task(asyncio.to_thread(waiter.get, "rank1"))
        await asyncio.sleep(1.0)  # the waiter is blocked this long: the test's input
        assert not waiting.done()
        set_at = time.monotonic()
        await asyncio.to_thread(writer.set, "rank1", b"10.0.0.2:5678")
        assert await asyncio.wait_for(waiting, 10) == b"10.0.0.2:5678"
        woke_s = time.monotonic() - set_at
        looks = await exists_calls(redis) - before
        # One look, then one more after each BLPOP (every WAKE_S at most, plus the wake-up): a 2 ms
        # poll looked ~500 times in that second.
        assert looks <= 2 + 1.0 / WAKE_S + 2, looks
        assert woke_s < WAKE_S, f"woken {woke_s:.2f} s after the set: by the set, not by the BLPOP timeout"
    finally:
        waiter.close()
        writer.close()


async def test_a_key_set_before_the_wait_is_seen_at_once(redis_url: str) -> None:
    store = RedisStore(redis_url, PREFIX, timeout_s=30)
    try:
        await asyncio.to_thread(store.set, "rank0", b"a")
        started = time.monotonic()
        await asyncio.to_thread(store.wait, ["rank0"])
        assert time.monotonic() - started < WAKE_S
        assert store.check(["rank0"]) and not store.check(["rank0", "rank9"])
        assert store.num_keys() == 1  # the wake list is not counted
    finally:
        store.close()


async def test_every_waiter_of_a_key_wakes(redis_url: str) -> None:
    stores = [RedisStore(redis_url, PREFIX, timeout_s=30) for _ in range(4)]
    try:
        waits = [asyncio.create_task(asyncio.to_thread(s.get, "go")) for s in stores[:3]]
        await asyncio.sleep(0.3)
        set_at = time.monotonic()
        await asyncio.to_thread(stores[3].set, "go", b"1")
        assert await asyncio.wait_for(asyncio.gather(*waits), 10) == [b"1"] * 3
        assert time.monotonic() - set_at < WAKE_S, "each woke the next, none waited out a BLPOP"
    finally:
        for s in stores:
            s.close()


async def test_add_wakes_a_waiter_too(redis_url: str) -> None:
    waiter, adder = RedisStore(redis_url, PREFIX, timeout_s=30), RedisStore(redis_url, PREFIX, timeout_s=30)
    try:
        waiting = asyncio.create_task(asyncio.to_thread(waiter.wait, ["count"]))
        await asyncio.sleep(0.2)
        assert await asyncio.to_thread(adder.add, "count", 2) == 2
        await asyncio.wait_for(waiting, 10)
    finally:
        waiter.close()
        adder.close()


async def test_a_wait_runs_out_or_is_called_off(redis_url: str) -> None:
    called_off = threading.Event()
    store = RedisStore(redis_url, PREFIX, timeout_s=1.0, called_off=called_off)
    try:
        with pytest.raises(RuntimeError, match=r"no peer wrote never under .* within 1 s"):
            await asyncio.to_thread(store.wait, ["never"])
        store.set_timeout(timedelta(seconds=30))
        waiting = asyncio.create_task(asyncio.to_thread(store.wait, ["never"]))
        await asyncio.sleep(0.2)
        called_off.set()
        started = time.monotonic()
        with pytest.raises(RuntimeError, match="called off"):
            await asyncio.wait_for(waiting, 10)
        assert time.monotonic() - started < WAKE_S + 0.5
    finally:
        store.close()


def test_a_wake_list_shares_its_keys_slot() -> None:
    assert wake_list("bt:{run}:plane:1:a") == "bt:{run}:plane:1:a:wake"
    assert wake_list("bt:run:plane:1:a") == "{bt:run:plane:1:a}:wake"
    assert wake_list("x{}y") == "{x{}y}:wake"
