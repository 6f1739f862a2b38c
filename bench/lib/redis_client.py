"""A bench's Redis client for a URL: a plain one for ``redis://``, and for a Redis Cluster URL
(``redis+cluster://``, issue 66) the project's own cluster client, `shared.bus.connection.command_client`,
so emulated workers and injectors reach the node each key lives on."""

from __future__ import annotations

from redis.asyncio import Redis

CLUSTER_SCHEME = "redis+cluster://"


def connect(url: str) -> Redis:
    if url.startswith(CLUSTER_SCHEME):
        from shared.bus.connection import command_client  # a RedisCluster for such a URL (issue 66)

        return command_client(url, name="bench")
    return Redis.from_url(url, protocol=2)
