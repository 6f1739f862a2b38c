"""A consumer's reclaim loop (mixed into `shared.bus.consumer.Consumer`, whose tables it reads):
refresh the idle time of entries still being handled or held, take over entries idle too long
(failed handlers, dead consumers), and trim fully-acked entries from the stream now and then."""

from __future__ import annotations

import asyncio
import time
from typing import Any

from redis.exceptions import ResponseError

from shared.bus.connection import TRANSIENT_ERRORS, Connected, backoff
from shared.bus.streams import ensure_group, group_is_gone, trim_acked
from shared.config.spec import BusConfig
from shared.runtime.logs import get_logger

log = get_logger(__name__)

#: Trim acked entries from the stream about this often.
TRIM_INTERVAL_S = 5.0
#: Upper bound on entries fetched per XREADGROUP: big enough to amortise the round trip under
#: load, small enough that one read does not hog the loop (a sequential consumer reclaims as many).
READ_BATCH = 256


class Reclaiming:
    """The reclaim half of `Consumer` (declared here for the type checker)."""

    bus: Connected
    stream: str
    group: str
    name: str
    config: BusConfig
    sequential: bool
    _inflight: dict[str, asyncio.Task[object]]
    _started_at: dict[str, float]
    _held: dict[str, float]
    _resync: asyncio.Event
    _fence: Any  # Fence | None
    stats: Any  # ConsumerStats

    def _busy(self) -> int:
        raise NotImplementedError

    async def _spawn_redelivered(self, entries: Any) -> None:
        raise NotImplementedError

    async def _reclaim_loop(self) -> None:
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
                self._resync.set()
                await asyncio.sleep(backoff().compute(failures))
            except ResponseError as exc:
                if not group_is_gone(exc):
                    raise
                await ensure_group(self.bus.redis, self.stream, self.group)

    async def _refresh_slow_handlers(self) -> None:
        """Reset the idle time of entries whose handlers are still running (not a new delivery)."""
        horizon = time.monotonic() - self.config.claim_idle_ms / 4000
        slow = [i for table in (self._started_at, self._held) for i, t in table.items() if t < horizon]
        if slow:
            await self.bus.redis.xclaim(
                self.stream, self.group, self.name, min_idle_time=0, message_ids=list[Any](slow), justid=True
            )
            now = time.monotonic()
            for table in (self._started_at, self._held):
                for i in slow:
                    if i in table:
                        table[i] = now

    async def _reclaim_idle(self) -> None:
        """Take over entries idle longer than claim_idle_ms (failed handlers, dead consumers)."""
        start = "0-0"
        while (free := self._reclaim_room()) > 0:
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
                self.stats.reclaimed += len(claimed)
                log.info("reclaimed idle entries", stream=self.stream, count=len(claimed), first=claimed[0][0].decode())
                if self._fence is not None:
                    await self._fence()
                await self._spawn_redelivered(claimed)
            start = next_start.decode() if isinstance(next_start, bytes) else next_start
            if start == "0-0":
                return

    def _reclaim_room(self) -> int:
        """Entries this consumer may take over now: a sequential one only while idle (a batch at
        a time keeps the stream's order), any other up to its free handler slots."""
        if self.sequential:
            return READ_BATCH if self._busy() == 0 else 0
        return self.config.concurrency - len(self._inflight)
