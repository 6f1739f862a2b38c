"""Every bus behaviour against a real redis-server. No test sleeps to give time: each waits on
the event it expects (a handler signal, a blocking read of the dead-letter stream) with a timeout."""

from __future__ import annotations

import asyncio
import sys
from collections import Counter
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
from redis.asyncio import Redis
from redis.exceptions import ConnectionError as RedisConnectionError

from shared.bus import HOLD, Bus, Delivery, Outcome, trim_acked
from shared.bus.consumer import Consumer
from shared.config.spec import BusConfig
from shared.runtime.redis_server import EmbeddedRedis
from shared.wire import FIELD, Ping, Pong, keys

FAST = BusConfig(claim_idle_ms=150, block_ms=200, max_deliveries=3, drain_grace_s=2.0)


def pings(n: int, start: int = 0) -> list[Ping]:
    return [Ping(seq=i, sent_ns=0) for i in range(start, start + n)]


class Seen:
    """Records handled seqs; `until(n)` waits until n distinct seqs were handled."""

    def __init__(self) -> None:
        self.calls: Counter[int] = Counter()
        self.attempts: dict[int, list[int]] = {}
        self._changed = asyncio.Event()

    async def __call__(self, d: Delivery) -> None:
        assert isinstance(d.message, Ping)
        self.add(d)

    def add(self, d: Delivery) -> None:
        assert isinstance(d.message, Ping)
        self.calls[d.message.seq] += 1
        self.attempts.setdefault(d.message.seq, []).append(d.attempt)
        self._changed.set()

    async def until(self, n: int, timeout: float = 60.0) -> None:
        async def wait() -> None:
            while len(self.calls) < n:
                self._changed.clear()
                await self._changed.wait()

        await asyncio.wait_for(wait(), timeout)


#: The dead-letter stream of the tests' stream "s" (in its slot: the name is its tag).
DEAD = keys.dead_letter_stream("s")


async def next_dead_letter(r: Redis, last_id: str = "0", timeout_ms: int = 60_000) -> tuple[str, dict]:
    """Block on the dead-letter stream until an entry newer than last_id arrives."""
    reply = await r.xread({DEAD: last_id}, count=1, block=timeout_ms)
    assert reply, "no dead letter arrived"
    entry_id, fields = reply[0][1][0]
    return entry_id.decode(), fields


async def pending_count(r: Redis, stream: str, group: str) -> int:
    return int((await r.xpending(stream, group))["pending"])


async def test_publish_consume_ack_each_once(redis_url: str, redis: Redis) -> None:
    seen = Seen()
    async with Bus(redis_url, FAST) as bus, bus.consumer("s", "g", {Ping: seen}) as c:
        await bus.publish_many("s", pings(500))
        await bus.publish("s", Ping(seq=500, sent_ns=1))
        await seen.until(501)
    assert set(seen.calls.values()) == {1}
    assert c.stats.handled == 501
    assert await pending_count(redis, "s", "g") == 0


async def test_messages_published_before_the_group_exists_are_delivered(redis_url: str) -> None:
    seen = Seen()
    async with Bus(redis_url, FAST) as bus:
        await bus.publish_many("early", pings(10))
        async with bus.consumer("early", "g", {Ping: seen}):
            await seen.until(10)


async def test_own_pending_entries_are_drained_first_on_restart(redis_url: str, redis: Redis) -> None:
    block = asyncio.Event()
    took = Seen()

    async def stuck(d: Delivery) -> None:
        took.add(d)
        await block.wait()

    async with Bus(redis_url, FAST.__class__(claim_idle_ms=60_000, concurrency=5)) as bus:
        c = await bus.consumer("s", "g", {Ping: stuck}, name="fixed").start()
        await bus.publish_many("s", pings(5))
        await took.until(5)
        await c.stop(grace_s=0)  # like a crash: handlers cancelled, nothing acked
        assert await pending_count(redis, "s", "g") == 5
        await bus.publish_many("s", pings(3, start=100))
        order: list[int] = []
        done = Seen()

        async def record(d: Delivery) -> None:
            assert isinstance(d.message, Ping)
            order.append(d.message.seq)
            done.add(d)

        async with bus.consumer("s", "g", {Ping: record}, name="fixed", config=BusConfig(concurrency=1)):
            await done.until(8)
    assert order[:5] == [0, 1, 2, 3, 4], "own pending entries must come before new ones"
    assert sorted(order[5:]) == [100, 101, 102]
    assert all(a == [2] for s, a in done.attempts.items() if s < 100)  # second delivery
    assert await pending_count(redis, "s", "g") == 0


async def test_entries_of_a_killed_consumer_are_reclaimed(redis_url: str, redis: Redis) -> None:
    async with Bus(redis_url, FAST) as bus:
        await bus.publish_many("s", pings(20))
        script = Path(__file__).with_name("hanging_consumer.py")
        proc = await asyncio.create_subprocess_exec(
            sys.executable, str(script), redis_url, "s", "g", "20", stdout=asyncio.subprocess.PIPE
        )
        assert proc.stdout is not None
        line = await asyncio.wait_for(proc.stdout.readline(), 30)
        assert line.strip() == b"took 20"
        proc.kill()  # SIGKILL: no drain, no acks
        await proc.wait()
        assert await pending_count(redis, "s", "g") == 20
        seen = Seen()
        async with bus.consumer("s", "g", {Ping: seen}, name="survivor") as c:
            await seen.until(20)
        assert c.stats.reclaimed >= 20
        # each came to the survivor on its second delivery; a handled entry whose ack was still queued
        # past this test's 150 ms claim idle may come a third time (at least once: a loaded machine)
        assert all(a[0] == 2 for a in seen.attempts.values())
        assert await pending_count(redis, "s", "g") == 0


async def test_undecodable_message_is_dead_lettered_with_its_ack(redis_url: str, redis: Redis) -> None:
    seen = Seen()
    async with Bus(redis_url, FAST) as bus, bus.consumer("s", "g", {Ping: seen}) as c:
        bad_id = (await redis.xadd("s", {FIELD: b"\xc1not msgpack"})).decode()
        await bus.publish("s", Ping(seq=1, sent_ns=0))
        _, dl = await next_dead_letter(redis)
        await seen.until(1)
    assert dl[b"id"].decode() == bad_id and dl[b"stream"] == b"s" and dl[b"group"] == b"g"
    assert dl[FIELD] == b"\xc1not msgpack"  # original payload kept for replay
    assert b"undecodable" in dl[b"error"]
    assert c.stats.dead_lettered == 1
    assert await pending_count(redis, "s", "g") == 0
    async with Bus(redis_url) as reader:
        letters = await reader.dead_letters(DEAD)
    assert [d.source_id for d in letters] == [bad_id]


async def test_a_huge_poison_message_is_dead_lettered_truncated_with_its_length_and_hash(
    redis_url: str, redis: Redis
) -> None:
    """bt:dead is bounded in bytes, not only in count: a 1 MB poison payload keeps its first
    DEAD_LETTER_PAYLOAD_MAX_BYTES, its length and SHA-256, and a note that it was cut."""
    import hashlib

    poison = b"\xc1" + bytes(range(256)) * 4096  # ~1 MB, undecodable
    async with Bus(redis_url, FAST) as bus, bus.consumer("s", "g", {Ping: Seen()}) as c:
        await redis.xadd("s", {FIELD: poison})
        _, dl = await next_dead_letter(redis)
    cap = keys.DEAD_LETTER_PAYLOAD_MAX_BYTES
    assert dl[FIELD] == poison[:cap]
    assert int(dl[b"payload_bytes"]) == len(poison) and dl[b"payload_truncated"] == b"1"
    assert dl[b"payload_sha256"].decode() == hashlib.sha256(poison).hexdigest()
    assert c.stats.dead_lettered == 1
    assert int(await redis.memory_usage(DEAD)) < 2 * cap  # not ~1 MB
    async with Bus(redis_url) as reader:
        [letter] = await reader.dead_letters(DEAD)
    assert letter.truncated and letter.payload_bytes == len(poison) and len(letter.payload) == cap


async def test_failing_handler_is_retried_then_dead_lettered(redis_url: str, redis: Redis) -> None:
    attempts: list[int] = []

    async def poison(d: Delivery) -> None:
        attempts.append(d.attempt)
        raise ValueError("cannot handle this")

    async with Bus(redis_url, FAST) as bus, bus.consumer("s", "g", {Ping: poison}) as c:
        await bus.publish("s", Ping(seq=7, sent_ns=0))
        _, dl = await next_dead_letter(redis)
    assert attempts == [1, 2, 3]  # max_deliveries=3
    assert int(dl[b"attempts"]) == 3 and b"cannot handle this" in dl[b"error"]
    assert c.stats.failed == 3 and c.stats.dead_lettered == 1
    assert await pending_count(redis, "s", "g") == 0


async def test_transient_failure_succeeds_on_retry(redis_url: str, redis: Redis) -> None:
    seen = Seen()

    async def flaky(d: Delivery) -> None:
        if d.attempt == 1:
            raise ConnectionResetError("downstream blip")
        seen.add(d)

    async with Bus(redis_url, FAST) as bus, bus.consumer("s", "g", {Ping: flaky}):
        await bus.publish_many("s", pings(3))
        await seen.until(3)
    assert all(a == [2] for a in seen.attempts.values())
    assert await redis.xlen(DEAD) == 0


async def test_survives_redis_restart_mid_stream(tmp_path: Path) -> None:
    server = EmbeddedRedis(persist=True, data_dir=str(tmp_path)).start()
    try:
        seen = Seen()
        async with Bus(server.url, FAST) as bus, bus.consumer("s", "g", {Ping: seen}) as c:
            await bus.publish_many("s", pings(100))
            await seen.until(100)
            server.kill()  # crash, no clean shutdown
            server.start()  # same port, same append-only file
            for m in pings(100, start=100):  # publishes ride the client's reconnect/retry
                await bus.publish("s", m)
            await seen.until(200)
            assert c.stats.reconnects >= 1
        r = Redis.from_url(server.url, protocol=2)
        assert (await r.xpending("s", "g"))["pending"] == 0
        await r.aclose()
        assert set(seen.calls) == set(range(200))
    finally:
        server.stop()


async def test_group_recreated_when_it_vanishes(redis_url: str, redis: Redis) -> None:
    seen = Seen()
    async with Bus(redis_url, FAST) as bus, bus.consumer("s", "g", {Ping: seen}):
        await bus.publish("s", Ping(seq=0, sent_ns=0))
        await seen.until(1)
        await redis.delete("s")  # stream and group gone, as after a restart without persistence
        await bus.publish("s", Ping(seq=1, sent_ns=0))
        await seen.until(2)


async def test_drain_finishes_in_flight_work_within_grace(redis_url: str, redis: Redis) -> None:
    started = Seen()
    release = asyncio.Event()
    finished: list[int] = []

    async def slow(d: Delivery) -> None:
        assert isinstance(d.message, Ping)
        started.add(d)
        await release.wait()
        finished.append(d.message.seq)

    async with Bus(redis_url, FAST) as bus:
        c = await bus.consumer("s", "g", {Ping: slow}).start()
        await bus.publish_many("s", pings(4))
        await started.until(4)
        stopping = asyncio.create_task(c.stop(grace_s=10))
        assert c._read_task is not None
        await asyncio.wait({c._read_task})  # reading has stopped; handlers still running
        assert not stopping.done()
        await bus.publish_many("s", pings(4, start=10))  # arrives after reading stopped: not taken
        release.set()
        await stopping
    assert sorted(finished) == [0, 1, 2, 3]
    assert await pending_count(redis, "s", "g") == 0  # all four acked during drain
    assert await redis.xlen("s") == 8  # the later four wait in the stream, unread


async def test_a_stopping_consumer_ends_its_blocked_read_on_the_server_too(redis_url: str, redis: Redis) -> None:
    """A blocked XREADGROUP cancelled only in the process stays blocked on the server until the server
    sees its connection close, and an entry added first is handed to it: into the stopped consumer's
    pending list, to wait `claim_idle_ms` for a claim (the drain test above failed so, now and then,
    under load). Stopping ends the read on the server (CLIENT UNBLOCK) before the loop ends, so an
    entry added at once waits unread for the next reader. Blocks of 10 s: no read ends by itself."""
    slow_reads = BusConfig(claim_idle_ms=60_000, block_ms=10_000, max_deliveries=3, drain_grace_s=2.0)
    started = Seen()
    release = asyncio.Event()

    async def slow(d: Delivery) -> None:
        started.add(d)
        await release.wait()

    async def blocked(name: str) -> bool:
        return any(c["name"] == name and "b" in c["flags"] for c in await redis.client_list(_type="normal"))

    async with Bus(redis_url, slow_reads) as bus:
        c = await bus.consumer("s", "g", {Ping: slow}).start()
        await bus.publish_many("s", pings(1))
        await started.until(1)
        reader = f"reader-{c.name}"
        async with asyncio.timeout(10):
            while not await blocked(reader):  # noqa: ASYNC110 (the server's state: nothing to wait on)
                await asyncio.sleep(0.01)
        stopping = asyncio.create_task(c.stop(grace_s=10))  # the handler holds the stop open
        assert c._read_task is not None
        await asyncio.wait({c._read_task})
        await bus.publish_many("s", pings(1, start=10))  # at once: a dropped connection's close races it
        # ended by the server, not by dropping the connection (whose close could come after the entry)
        readers = [cl for cl in await redis.client_list(_type="normal") if cl["name"] == reader]
        assert readers and not await blocked(reader), readers
        release.set()
        await stopping
    assert await pending_count(redis, "s", "g") == 0
    assert await redis.xlen("s") == 2


async def test_drain_cancels_after_grace_and_work_is_redelivered(redis_url: str, redis: Redis) -> None:
    started = Seen()
    never = asyncio.Event()

    async def stuck(d: Delivery) -> None:
        started.add(d)
        await never.wait()

    async with Bus(redis_url, FAST) as bus:
        c = await bus.consumer("s", "g", {Ping: stuck}).start()
        await bus.publish_many("s", pings(3))
        await started.until(3)
        await c.stop(grace_s=0.05)
        assert await pending_count(redis, "s", "g") == 3
        again = Seen()
        async with bus.consumer("s", "g", {Ping: again}):
            await again.until(3)


async def test_idempotent_handlers_give_exactly_once_effect(redis_url: str, redis: Redis) -> None:
    """Crash after the effect but before the ack: the entry is redelivered, the effect stays single."""
    n = 50
    executions: Counter[int] = Counter()
    taken_by_a = Seen()
    done = Seen()

    def handler(crashes: bool) -> Callable[[Delivery], Awaitable[None]]:
        async def effect(d: Delivery) -> None:
            assert isinstance(d.message, Ping)
            executions[d.message.seq] += 1
            await redis.hsetnx("effects", str(d.message.seq), d.id)  # idempotent write
            if crashes:
                taken_by_a.add(d)
                if d.message.seq % 2 == 0:
                    await asyncio.Event().wait()  # "dies" after the effect, before the ack
            done.add(d)

        return effect

    async with Bus(redis_url, FAST) as bus:
        a = await bus.consumer("s", "g", {Ping: handler(crashes=True)}, name="a").start()
        await bus.publish_many("s", pings(n))
        await taken_by_a.until(n)  # a holds every entry: odd ones done, even ones stuck
        assert len(done.calls) == n // 2
        b = await bus.consumer("s", "g", {Ping: handler(crashes=False)}, name="b").start()
        await a.stop(grace_s=0)  # crash a: its stuck entries stay pending, effects already written
        await done.until(n)  # b reclaims and re-runs them
        await b.stop()
    assert sum(executions.values()) == n + n // 2  # every even entry really ran twice...
    assert await redis.hlen("effects") == n  # ...yet each effect happened once
    assert b.stats.reclaimed == n // 2
    assert await pending_count(redis, "s", "g") == 0


async def test_an_entry_whose_ack_is_slow_to_land_is_handled_once(
    redis_url: str, redis: Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Between a handler's end and Redis confirming its XACK the entry is still in hand: neither its
    consumer's own reclaim pass nor a peer's takes it over, though the ack takes three claim_idle
    periods to land (as it does on a stalled host or through a lost connection)."""
    monkeypatch.setattr("shared.bus.acks.GATHER_S", 3 * FAST.claim_idle_ms / 1000)
    n = 20
    executions: Counter[int] = Counter()
    done = Seen()

    async def effect(d: Delivery) -> None:
        assert isinstance(d.message, Ping)
        executions[d.message.seq] += 1
        done.add(d)

    async with Bus(redis_url, FAST) as bus:
        a = bus.consumer("s", "g", {Ping: effect}, name="a")
        b = bus.consumer("s", "g", {Ping: effect}, name="b")
        async with a, b:
            await bus.publish_many("s", pings(n))
            await done.until(n)
            for _ in range(200):  # the acks land after GATHER_S
                if await pending_count(redis, "s", "g") == 0:
                    break
                await asyncio.sleep(0.05)
            await asyncio.sleep(2 * FAST.claim_idle_ms / 1000)  # reclaim passes that would re-run them
    assert sorted(executions) == list(range(n)) and set(executions.values()) == {1}, executions
    assert a.stats.reclaimed == b.stats.reclaimed == 0
    assert await pending_count(redis, "s", "g") == 0


async def test_slow_live_handler_is_not_stolen_by_a_peer(redis_url: str, redis: Redis) -> None:
    """A handler running for many claim_idle periods keeps its entry: its idle time is refreshed."""
    release = asyncio.Event()
    calls: Counter[str] = Counter()
    started = asyncio.Event()

    async def slow(d: Delivery) -> None:
        calls[d.id] += 1
        started.set()
        await release.wait()

    # The handler's entry is refreshed every quarter of claim_idle, so a peer could steal it only
    # if the host stalled the holder for about half of claim_idle: 250 ms here, not 50 ms.
    cfg = BusConfig(claim_idle_ms=500, block_ms=100)
    async with Bus(redis_url, cfg) as bus:
        a = bus.consumer("s", "g", {Ping: slow}, name="a")
        b = bus.consumer("s", "g", {Ping: slow}, name="b")
        async with a, b:
            await bus.publish("s", Ping(seq=1, sent_ns=0))
            await asyncio.wait_for(started.wait(), 30)
            # The property is about a span of time (the test's input): the peers' reclaim passes
            # (every 125 ms) run for four claim_idle periods; the Redis clock decides idleness.
            await asyncio.sleep(2.0)
            rows = await redis.xpending_range("s", "g", "-", "+", 10)
            release.set()
    assert list(calls.values()) == [1]
    assert [r["times_delivered"] for r in rows] == [1]
    assert a.stats.reclaimed == b.stats.reclaimed == 0


async def test_trim_drops_only_acked_entries(redis_url: str, redis: Redis) -> None:
    seen = Seen()
    async with Bus(redis_url, FAST) as bus:
        async with bus.consumer("s", "g", {Ping: seen}):
            await bus.publish_many("s", pings(10))
            await seen.until(10)
        await bus.publish_many("s", pings(5, start=10))  # nobody has read these
        await redis.xgroup_create("s", "late", id="0")  # a second group that read nothing
        assert await trim_acked(redis, "s", soft_max_len=100) == 0  # "late" still needs all 15
        await redis.xgroup_destroy("s", "late")
        assert await trim_acked(redis, "s", soft_max_len=100) == 10
        assert await redis.xlen("s") == 5
        assert await redis.xlen("no-such-stream") == 0
        assert await trim_acked(redis, "no-such-stream", soft_max_len=100) == 0


async def test_trim_keeps_backlog_over_the_bound_and_says_so(
    redis_url: str, redis: Redis, caplog: pytest.LogCaptureFixture
) -> None:
    async with Bus(redis_url, FAST) as bus:
        await redis.xgroup_create("s", "g", id="0", mkstream=True)
        await bus.publish_many("s", pings(150))
        assert await trim_acked(redis, "s", soft_max_len=100) == 0
    assert await redis.xlen("s") == 150
    assert any("backlog over its bound" in r.getMessage() for r in caplog.records)


async def test_rejected_message_is_dead_lettered_at_once(redis_url: str, redis: Redis) -> None:
    from shared.bus import Reject

    attempts: list[int] = []

    async def refuse(d: Delivery) -> None:
        attempts.append(d.attempt)
        raise Reject("names a link that does not exist")

    async with Bus(redis_url, FAST) as bus, bus.consumer("s", "g", {Ping: refuse}):
        await bus.publish("s", Ping(seq=1, sent_ns=0))
        _, dl = await next_dead_letter(redis)
    assert attempts == [1]
    assert b"rejected: names a link" in dl[b"error"]
    assert await pending_count(redis, "s", "g") == 0


async def test_a_kind_outside_the_handler_table_is_dead_lettered_naming_stream_and_kind(
    redis_url: str, redis: Redis
) -> None:
    seen = Seen()
    async with Bus(redis_url, FAST) as bus, bus.consumer("s", "g", {Ping: seen}) as c:
        await bus.publish("s", Pong(seq=1, sent_ns=0))
        _, dl = await next_dead_letter(redis)
        await bus.publish("s", Ping(seq=2, sent_ns=0))
        await seen.until(1)  # the consumer goes on with the kinds it takes
    assert dl[b"error"] == b"rejected: stream s takes ping; got kind 'pong'"
    assert dl[b"stream"] == b"s"
    assert c.stats.dead_lettered == 1
    assert await pending_count(redis, "s", "g") == 0


async def test_a_held_entry_stays_pending_and_ours_until_released(redis_url: str, redis: Redis) -> None:
    """HOLD: acked only on `release`; meanwhile its idle time is refreshed, so a peer's reclaim
    loop never takes it, and it does not count against the consumer's concurrency."""
    held: list[str] = []
    all_held = asyncio.Event()
    stolen = Seen()

    async def hold(d: Delivery) -> Outcome:
        held.append(d.id)
        if len(held) == 3:
            all_held.set()
        return HOLD

    # Held entries are refreshed every quarter of claim_idle: a peer could steal one only if the
    # host stalled the holder for about half of claim_idle (250 ms here).
    slow_claims = BusConfig(claim_idle_ms=500, block_ms=200, max_deliveries=3)
    one_at_a_time = BusConfig(claim_idle_ms=500, block_ms=200, max_deliveries=3, concurrency=1)
    async with Bus(redis_url, slow_claims) as bus:
        c = await bus.consumer("s", "g", {Ping: hold}, name="holder", config=one_at_a_time).start()
        await bus.publish_many("s", pings(3))
        await asyncio.wait_for(all_held.wait(), 30)  # concurrency 1: held entries do not block the next
        async with bus.consumer("s", "g", {Ping: stolen}, name="peer"):
            # The property is about a span of time (the test's input): four claim_idle periods,
            # after which an unrefreshed entry would have been reclaimed by the peer.
            await asyncio.sleep(2.0)
        assert stolen.calls == Counter()
        assert await pending_count(redis, "s", "g") == 3
        assert c.stats.held == 3
        for entry_id in held:
            c.release(entry_id)
        await c.stop()  # flushes the acks
    assert c.stats.held == 0


async def test_a_sequential_consumer_reads_in_batches_handles_in_order_and_acks_after_its_flush(
    redis_url: str, redis: Redis
) -> None:
    """One read, one task: handlers in stream order, then `after_read` with the ids to ack (held
    ones left out); it acks them in its own round trip (or leaves them to the consumer); a read
    whose `after_read` fails leaves its entries pending."""
    order: list[int] = []
    reads: list[list[str]] = []
    flushed, acked = asyncio.Event(), asyncio.Event()
    fail = [False]

    async def handle(d: Delivery) -> Outcome | None:
        assert isinstance(d.message, Ping)
        order.append(d.message.seq)
        return HOLD if d.message.seq == 3 else None  # one held: acked only when released

    async with Bus(redis_url, FAST, name="test") as bus:
        consumer: Consumer | None = None

        async def after_read(done: list[str]) -> bool:
            reads.append(done)
            flushed.set()
            if fail[0]:
                raise RuntimeError("the flush failed")
            assert consumer is not None
            async with redis.pipeline(transaction=False) as pipe:
                consumer.ack_on(pipe, done)
                await pipe.execute()
            acked.set()
            return True

        await bus.publish_many("seq", pings(20))
        consumer = bus.consumer("seq", "g", {Ping: handle}, sequential=True, after_read=after_read)
        async with consumer:
            await asyncio.wait_for(acked.wait(), 30)
            assert order == list(range(20)) and len(reads) == 1  # one read, in order
            assert len(reads[0]) == 19  # the held one is not the flush's to ack
            pending: Any = await redis.xpending("seq", "g")
            assert pending["pending"] == 1  # only the held entry
            fail[0] = True
            flushed.clear()
            await bus.publish_many("seq", pings(2, start=100))
            await asyncio.wait_for(flushed.wait(), 30)  # the second read's flush, failing
        pending = await redis.xpending("seq", "g")
        assert pending["pending"] == 3  # the failed read's two entries stay pending, with the held one


async def test_a_consumer_whose_fence_fails_hands_nothing_to_its_handlers(redis_url: str, redis: Redis) -> None:
    """A stale stage worker (its slot another's) reads its replacement's inbox as the same consumer
    name: its fence raises before any entry read is handled, and the consumer stops (crashed, with
    the fence's error), the entries left pending for the live holder to reclaim."""
    seen, stale = Seen(), asyncio.Event()

    class Stale(RuntimeError):
        pass

    async def fence() -> None:
        if stale.is_set():
            raise Stale("the slot is another's")

    async with Bus(redis_url, FAST) as bus, bus.consumer("f", "g", {Ping: seen}, fence=fence) as c:
        await bus.publish_many("f", pings(3))
        await seen.until(3)
        stale.set()
        await bus.publish_many("f", pings(5, start=3))
        await asyncio.wait_for(c.crashed.wait(), 30)
        assert isinstance(c.error, Stale)
    assert sorted(seen.calls) == [0, 1, 2]  # nothing read after the fence failed was handled
    assert await pending_count(redis, "f", "g") >= 1  # what it read stays pending, for the holder


async def test_a_connection_lost_between_a_read_and_its_hand_out_is_ridden_out(redis_url: str, redis: Redis) -> None:
    """The read succeeded, then a call it makes before handing the entries out (the fence's lease
    check, the delivery counts of entries read again) fails on the connection, as in a master's
    failover: the consumer backs off and re-reads its own pending entries, it does not crash (a
    failover run saw the read loop of a worker and of the WAN broker die so, and the services exit).
    The fence here fails as its Redis call would: once, with redis-py's ConnectionError."""
    seen, failed = Seen(), asyncio.Event()

    async def fence() -> None:
        if not failed.is_set():
            failed.set()
            raise RedisConnectionError("Error 111 connecting to the old master. Connection refused.")

    async with Bus(redis_url, FAST) as bus, bus.consumer("f", "g", {Ping: seen}, fence=fence) as c:
        await bus.publish_many("f", pings(5))
        await seen.until(5)
        assert not c.crashed.is_set() and c.error is None
        assert c.stats.reconnects >= 1
    assert sorted(seen.calls) == list(range(5))
    assert await pending_count(redis, "f", "g") == 0
