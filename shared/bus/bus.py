"""The publishing side of the bus, and the factory for consumers. One `Bus` per process."""

from __future__ import annotations

import os
import secrets
import socket
from collections.abc import Iterable
from dataclasses import dataclass
from types import TracebackType
from typing import Any

from shared import keys
from shared.bus.connection import command_client
from shared.bus.consumer import Consumer
from shared.bus.delivery import Handlers
from shared.config import BusConfig
from shared.wire import FIELD, Message, encode


@dataclass(frozen=True, slots=True)
class DeadLetter:
    """An entry of the dead-letter stream: where a message came from and why it was given up."""

    id: str
    stream: str
    group: str
    source_id: str
    consumer: str
    attempts: int
    error: str
    payload: bytes


def default_consumer_name(prefix: str = "c") -> str:
    """Unique per process; stable names (e.g. a worker's slot) can be passed instead."""
    return f"{prefix}-{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(3)}"


class Bus:
    """Publish typed messages to streams; create consumers that handle them.

    Creating a `Bus` does no I/O; the pooled connection opens on first use. Close it with
    `aclose()` (or ``async with``) after every consumer made from it has stopped.
    """

    def __init__(self, url: str, config: BusConfig | None = None, *, name: str = "bubbletea") -> None:
        self.url = url
        self.config = config or BusConfig()
        self.name = name
        self.redis = command_client(url, name=name)

    async def __aenter__(self) -> Bus:
        return self

    async def __aexit__(
        self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        await self.redis.aclose()

    async def publish(self, stream: str, msg: Message, *, maxlen: int | None = None) -> str:
        """Append one message; returns its entry id.

        `maxlen` trims the stream approximately *regardless of readers*: only for streams where
        losing old entries is by design (telemetry). Work streams are trimmed by consumers with
        `shared.bus.streams.trim_acked`, which never drops unread entries.
        """
        entry_id: Any = await self.redis.xadd(stream, {FIELD: encode(msg)}, maxlen=maxlen, approximate=True)
        return entry_id.decode()

    async def publish_many(self, stream: str, msgs: Iterable[Message], *, maxlen: int | None = None) -> list[str]:
        """Append many messages in one round trip (pipelined, not transactional)."""
        async with self.redis.pipeline(transaction=False) as pipe:
            for msg in msgs:
                pipe.xadd(stream, {FIELD: encode(msg)}, maxlen=maxlen, approximate=True)
            ids = await pipe.execute()
        return [i.decode() for i in ids]

    def consumer(
        self, stream: str, group: str, handlers: Handlers, *, name: str | None = None, config: BusConfig | None = None
    ) -> Consumer:
        """A consumer of `stream` in `group` with its handler table (`{message kind: handler}`);
        start it with ``async with`` or `Consumer.start`."""
        return Consumer(
            self, stream, group, handlers, name=name or default_consumer_name(group), config=config or self.config
        )

    async def dead_letters(self, count: int = 100) -> list[DeadLetter]:
        """The oldest `count` entries of the dead-letter stream (for operators and tests)."""
        rows: Any = await self.redis.xrange(keys.DEAD_LETTER_STREAM, count=count)
        out = []
        for entry_id, f in rows:
            out.append(
                DeadLetter(
                    id=entry_id.decode(),
                    stream=f[b"stream"].decode(),
                    group=f[b"group"].decode(),
                    source_id=f[b"id"].decode(),
                    consumer=f[b"consumer"].decode(),
                    attempts=int(f[b"attempts"]),
                    error=f[b"error"].decode(errors="replace"),
                    payload=f.get(FIELD, b""),
                )
            )
        return out
