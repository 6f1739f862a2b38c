"""A consumer's reclaim loop: keep the entries it has in hand its own, and take over the group's
abandoned ones.

Every quarter of `claim_idle_ms` it refreshes the idle time of entries still being handled or held
(XCLAIM JUSTID: not a new delivery), takes over entries idle longer than `claim_idle_ms` (failed
handlers, dead consumers: XAUTOCLAIM) and hands them to its consumer, and now and then trims
fully-acked entries from the stream. `Reclaimer` is an object the consumer holds
(`shared.bus.consumer.Consumer`); the tables it reads are the consumer's `InHand`.
tests/integration/test_bus.py covers it (a killed consumer's entries reclaimed, a slow live
handler not stolen, trimming).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Any

from redis.exceptions import ResponseError

from shared.bus.connection import TRANSIENT_ERRORS, Connected, backoff
from shared.bus.in_hand import InHand
from shared.bus.streams import ensure_group, group_is_gone, trim_acked
from shared.config.spec import BusConfig
from shared.runtime.logs import get_logger

log = get_logger(__name__)

#: Trim acked entries from the stream about this often.
TRIM_INTERVAL_S = 5.0
#: Upper bound on entries fetched per XREADGROUP: big enough to amortise the round trip under
#: load, small enough that one read does not hog the loop (a sequential consumer reclaims as many).
READ_BATCH = 256

#: Entries as Redis returns them: (id, fields), the fields None for one deleted from the stream.
Entries = list[tuple[bytes, dict[bytes, bytes] | None]]
#: What takes over entries reclaimed from the group (the consumer: fence, then handle them).
TakeOver = Callable[[Entries], Awaitable[None]]


class Reclaimer:
    """The reclaim loop of consumer `name` of `group` on `stream` (`run`, a task of its consumer's).
    A pass that fails on the connection sets `resync`: the consumer re-reads its own pending
    entries, as a reply may have been lost."""

    def __init__(
        self,
        bus: Connected,
        stream: str,
        group: str,
        name: str,
        config: BusConfig,
        in_hand: InHand,
        take_over: TakeOver,
        resync: asyncio.Event,
    ) -> None:
        self.bus, self.stream, self.group, self.name, self.config = bus, stream, group, name, config
        self.in_hand, self.take_over, self.resync = in_hand, take_over, resync

    async def run(self) -> None:
        # Every quarter of claim_idle: a live slow handler's entry is refreshed before it is half
        # idle, leaving half of claim_idle as margin for scheduling jitter before a peer may steal it.
        interval = max(self.config.claim_idle_ms / 4000, 0.005)
        last_trim = time.monotonic()
        failures = 0
        while True:
            await asyncio.sleep(interval)  # a periodic timer: idleness is measured in wall time
            try:
                await self._refresh_slow_handlers()
                await self._reclaim_idle()
                if time.monotonic() - last_trim > TRIM_INTERVAL_S:
                    last_trim = time.monotonic()
                    await trim_acked(self.bus.redis, self.stream, soft_max_len=self.config.max_stream_len)
                failures = 0
            except TRANSIENT_ERRORS as exc:
                failures += 1
                log.warning("reclaim pass failed; will retry", stream=self.stream, error=repr(exc))
                self.resync.set()
                await asyncio.sleep(backoff().compute(failures))
            except ResponseError as exc:
                if not group_is_gone(exc):
                    raise
                await ensure_group(self.bus.redis, self.stream, self.group)

    async def _refresh_slow_handlers(self) -> None:
        """Reset the idle time of entries whose handlers are still running, or held (not a new delivery)."""
        slow = self.in_hand.older_than(time.monotonic() - self.config.claim_idle_ms / 4000)
        if slow:
            await self.bus.redis.xclaim(
                self.stream, self.group, self.name, min_idle_time=0, message_ids=list[Any](slow), justid=True
            )
            self.in_hand.refreshed(slow, time.monotonic())

    async def _reclaim_idle(self) -> None:
        """Take over entries idle longer than claim_idle_ms (failed handlers, dead consumers)."""
        start = "0-0"
        while (free := self._room()) > 0:
            reply: Any = await self.bus.redis.xautoclaim(
                self.stream, self.group, self.name, min_idle_time=self.config.claim_idle_ms, start_id=start, count=free
            )
            next_start, claimed = reply[0], reply[1]
            for deleted in reply[2] if len(reply) > 2 else []:
                log.warning(
                    "pending entry was deleted from the stream before it was handled",
                    stream=self.stream,
                    id=deleted.decode(),
                )
            if claimed:
                await self.take_over(claimed)
            start = next_start.decode() if isinstance(next_start, bytes) else next_start
            if start == "0-0":
                return

    def _room(self) -> int:
        """Entries this consumer may take over now: a sequential one only while idle (a batch at
        a time keeps the stream's order), any other up to its free handler slots."""
        if self.in_hand.sequential:
            return READ_BATCH if self.in_hand.busy() == 0 else 0
        return self.in_hand.free()
