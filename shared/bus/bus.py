"""The publishing side of the bus, and the factory for consumers. One `Bus` per process."""

from __future__ import annotations

import asyncio
import os
import secrets
import socket
from collections.abc import Awaitable, Callable, Iterable
from types import TracebackType
from typing import Any

from shared.bus.connection import RIDE_OUT_S, command_client, ride_out
from shared.bus.consumer import AfterRead, Consumer, Fence
from shared.bus.deadletters import DeadLetter, LastWord, read_dead_letters
from shared.bus.delivery import Handlers
from shared.config.spec import BusConfig
from shared.wire import FIELD, Message, encode


def default_consumer_name(prefix: str = "c") -> str:
    """Unique per process; stable names (e.g. a worker's slot) can be passed instead."""
    return f"{prefix}-{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(3)}"


class Bus:
    """Publish typed messages to streams; create consumers that handle them.

    Creating a `Bus` does no I/O; the pooled connection opens on first use. Close it with
    `aclose()` (or ``async with``) after every consumer made from it has stopped.
    """

    def __init__(
        self,
        url: str,
        config: BusConfig | None = None,
        *,
        name: str = "bubbletea",
        ride_out_s: float = RIDE_OUT_S,
        stop: asyncio.Event | None = None,
    ) -> None:
        self.url = url
        self.config = config or BusConfig()
        self.name = name
        self.redis = command_client(url, name=name)
        #: How long `publish` keeps retrying through a Redis outage (beyond the client's own few
        #: retries) before raising; 0: fail as soon as the client gives up (the front door, which
        #: answers 503 rather than keep a client waiting).
        self.ride_out_s = ride_out_s
        #: The process's stop: once set, a publish riding out an outage gives up at once (`ride_out`'s
        #: `unless`). For a service whose stop only stops (the dispatcher); not for a stage worker,
        #: whose SIGTERM asks it to hand its slot over, through Redis, outage or not.
        self.stop = stop

    async def __aenter__(self) -> Bus:
        return self

    async def __aexit__(
        self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        await self.redis.aclose()

    async def publish(
        self, stream: str, msg: Message, *, maxlen: int | None = None, ride_out_s: float | None = None
    ) -> str:
        """Append one message; returns its entry id.

        `maxlen` trims the stream approximately *regardless of readers*: only for streams where
        losing old entries is by design (telemetry). Work streams are trimmed by consumers with
        `shared.bus.streams.trim_acked`, which never drops unread entries. `ride_out_s`
        overrides the bus's `ride_out_s` for this call.
        """
        data: dict[Any, Any] = {FIELD: encode(msg)}

        async def xadd() -> Any:
            return await self.redis.xadd(stream, data, maxlen=maxlen, approximate=True)

        entry_id: Any = await self._ride_out(xadd, stream, ride_out_s)
        return entry_id.decode()

    async def publish_many(self, stream: str, msgs: Iterable[Message], *, maxlen: int | None = None) -> list[str]:
        """Append many messages in one round trip (pipelined, not transactional)."""
        payloads = [encode(msg) for msg in msgs]

        async def xadds() -> Any:
            async with self.redis.pipeline(transaction=False) as pipe:
                for payload in payloads:
                    pipe.xadd(stream, {FIELD: payload}, maxlen=maxlen, approximate=True)
                return await pipe.execute()

        ids = await self._ride_out(xadds, stream, None)
        return [i.decode() for i in ids]

    async def _ride_out(self, op: Callable[[], Awaitable[Any]], stream: str, ride_out_s: float | None) -> Any:
        """A publish rides out a Redis restart: the client retries a few times, then `ride_out`
        backs off and retries for up to `ride_out_s` (at-least-once: a retried XADD whose reply
        was lost may land twice; consumers are idempotent)."""
        give_up_s = self.ride_out_s if ride_out_s is None else ride_out_s
        if give_up_s <= 0:
            return await op()
        return await ride_out(op, f"publish to {stream}", give_up_s=give_up_s, unless=self.stop)

    def consumer(
        self,
        stream: str,
        group: str,
        handlers: Handlers,
        *,
        name: str | None = None,
        config: BusConfig | None = None,
        sequential: bool = False,
        after_read: AfterRead | None = None,
        last_word: LastWord | None = None,
        fence: Fence | None = None,
    ) -> Consumer:
        """A consumer of `stream` in `group` with its handler table (`{message kind: handler}`);
        start it with ``async with`` or `Consumer.start`. `sequential`: each read's entries are
        handled in order in one task, then `after_read` runs, then they are acked. `last_word`:
        called with an entry's payload before it is dead-lettered (`LastWord`). `fence`: awaited
        before entries are handled, raising where they are no longer this consumer's (`Fence`)."""
        return Consumer(
            self,
            stream,
            group,
            handlers,
            name=name or default_consumer_name(group),
            config=config or self.config,
            sequential=sequential,
            after_read=after_read,
            last_word=last_word,
            fence=fence,
        )

    async def dead_letters(self, stream: str, count: int = 100) -> list[DeadLetter]:
        """The oldest `count` entries of a dead-letter stream (for operators and tests): a run's
        (`keys.run_dead_letter_stream`), or a stream's (`keys.dead_letter_stream`)."""
        return await read_dead_letters(self.redis, count, stream)
