"""A consumer-group reader with at-least-once delivery and exactly-once *effect* for idempotent handlers.

Life of an entry, as this consumer sees it:

1. On start it first re-reads its **own pending entries** (delivered to this consumer name before
   a crash or a lost connection, never acked), then blocks for new ones (``>``).
2. Each entry is decoded and handed to the handler its kind has in the consumer's **handler
   table** (`shared.bus.delivery`), in its own task (at most ``config.concurrency`` at once); a
   kind the table does not name is dead-lettered. The entry is **acked only after the handler
   returns**, or, if the handler returns `HOLD`, when the service calls `release` (the entry stays
   pending and refreshed meanwhile, without a task). Acks are batched into one XACK per wake-up,
   so under load many acks share a round trip.
3. If the handler raises, the entry stays pending. After ``claim_idle_ms`` idle the **reclaim
   loop** (XAUTOCLAIM, run by every consumer of the group) takes it over and retries it. The same
   loop takes over entries left behind by a consumer that died.
4. An entry that cannot be decoded, or has failed ``max_deliveries`` times, is moved to the
   **dead-letter stream** in one MULTI/EXEC with its XACK: it is never both lost and acked.
5. While a handler runs longer than a quarter of ``claim_idle_ms``, the reclaim loop refreshes the
   entry's idle time (XCLAIM JUSTID, which does not count as a delivery), so a slow but live
   handler is not mistaken for a dead one; held entries are refreshed the same way.

Connection loss (e.g. a Redis restart) never crashes the consumer: reads back off and reconnect,
the group is recreated if it vanished, unsent acks are kept and retried, and the own-pending pass
runs again. Shutdown (`stop`) stops reading, lets in-flight handlers finish within the grace
period, cancels the rest (they stay pending and are redelivered), flushes acks, then closes.

The read, handle and reclaim loops are one state machine over the same in-flight and held tables,
so they stay together here. What stands alone lives beside it: `delivery.py` (the handler table),
`acks.py` (batched acks), `deadletters.py` (dead letters), `streams.py` (groups, trimming).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import time
from dataclasses import dataclass
from types import TracebackType
from typing import Any

from redis.exceptions import ResponseError

from shared.bus.acks import Acks
from shared.bus.connection import BLOCKING_SLACK_S, TRANSIENT_ERRORS, Connected, backoff, blocking_client
from shared.bus.deadletters import dead_letter
from shared.bus.delivery import HOLD, Delivery, Handlers, Reject, route
from shared.bus.streams import delivery_counts, ensure_group, group_is_gone, trim_acked
from shared.runtime.logs import get_logger
from shared.spec.config import BusConfig
from shared.wire import FIELD, WireError, decode, kind_of

log = get_logger(__name__)

#: Upper bound on entries fetched per XREADGROUP: big enough to amortise the round trip under
#: load, small enough that one read does not hog the loop.
READ_BATCH = 256

#: Trim acked entries from the stream about this often.
TRIM_INTERVAL_S = 5.0


@dataclass
class ConsumerStats:
    handled: int = 0
    failed: int = 0
    dead_lettered: int = 0
    reclaimed: int = 0
    reconnects: int = 0
    in_flight: int = 0
    held: int = 0


class Consumer:
    def __init__(
        self, bus: Connected, stream: str, group: str, handlers: Handlers, *, name: str, config: BusConfig
    ) -> None:
        self.bus = bus
        self.stream = stream
        self.group = group
        self.name = name
        self.config = config
        self.stats = ConsumerStats()
        if not handlers:
            raise ValueError(f"a consumer of {stream} needs a handler table with at least one message kind")
        self._handlers = dict(handlers)
        self._reader = blocking_client(bus.url, name=f"reader-{name}")
        self._inflight: dict[str, asyncio.Task[None]] = {}
        self._started_at: dict[str, float] = {}
        #: Entries whose handler returned HOLD: pending, ours, refreshed, until `release`.
        self._held: dict[str, float] = {}
        self._slot_freed = asyncio.Event()
        self._acks = Acks(bus, stream, group)
        self._stopping = False
        self._read_task: asyncio.Task[None] | None = None
        self._reclaim_task: asyncio.Task[None] | None = None
        self._ack_task: asyncio.Task[None] | None = None
        self._resync = asyncio.Event()  # set when the own-pending pass must run again
        #: Set if a background loop died of an unexpected error; services watch it and exit.
        self.crashed = asyncio.Event()
        self.error: BaseException | None = None

    # --- lifecycle -------------------------------------------------------------------------

    async def start(self) -> Consumer:
        await ensure_group(self.bus.redis, self.stream, self.group)
        self._read_task = asyncio.create_task(self._read_loop(), name=f"read:{self.stream}")
        self._reclaim_task = asyncio.create_task(self._reclaim_loop(), name=f"reclaim:{self.stream}")
        self._ack_task = asyncio.create_task(self._acks.run(), name=f"ack:{self.stream}")
        for task in (self._read_task, self._reclaim_task, self._ack_task):
            task.add_done_callback(self._loop_ended)
        log.info("consumer started", stream=self.stream, group=self.group, consumer=self.name)
        return self

    async def stop(self, grace_s: float | None = None) -> None:
        """Drain: stop reading, give in-flight handlers `grace_s`, cancel the rest, flush acks."""
        grace = self.config.drain_grace_s if grace_s is None else grace_s
        # The flag, not only the cancel, ends the read loop: redis-py may surface a cancelled
        # blocking read as a ConnectionError, which the loop would otherwise retry.
        self._stopping = True
        await _cancel_and_wait(self._read_task)
        pending: set[asyncio.Task[None]] = set()
        if self._inflight:
            _, pending = await asyncio.wait(list(self._inflight.values()), timeout=grace)
            for task in pending:
                task.cancel()
            await asyncio.gather(*pending, return_exceptions=True)
        await _cancel_and_wait(self._reclaim_task)
        self._acks.close()
        if self._ack_task is not None:
            # asyncio.wait, not wait_for: on 3.11 wait_for can swallow our own cancellation.
            done, _ = await asyncio.wait({self._ack_task}, timeout=max(grace, 1.0))
            if not done:
                await _cancel_and_wait(self._ack_task)
                log.warning(
                    "acks not flushed before shutdown; those entries will be redelivered",
                    stream=self.stream,
                    unacked=len(self._acks),
                )
        await self._reader.aclose()
        log.info(
            "consumer stopped",
            stream=self.stream,
            group=self.group,
            consumer=self.name,
            handled=self.stats.handled,
            cancelled=len(pending),
        )

    def _loop_ended(self, task: asyncio.Task[None]) -> None:
        """A background loop must only end by cancellation (or the ack loop on close)."""
        if not task.cancelled() and task.exception() is not None:
            self.error = task.exception()
            self.crashed.set()
            log.error("consumer loop crashed", stream=self.stream, loop=task.get_name(), error=repr(self.error))

    async def __aenter__(self) -> Consumer:
        return await self.start()

    async def __aexit__(
        self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.stop()

    def release(self, entry_id: str) -> None:
        """Ack an entry its handler held (`HOLD`): its effect has now happened. Unknown ids (already
        released, or held by a previous incarnation) are acked too: acking is idempotent."""
        self._held.pop(entry_id, None)
        self.stats.held = len(self._held)
        self._acks.add(entry_id)

    # --- reading ---------------------------------------------------------------------------

    async def _read_loop(self) -> None:
        cursor = "0"  # "0": our own pending entries first; ">": new entries
        failures = 0
        while not self._stopping:
            if self._resync.is_set():
                self._resync.clear()
                cursor = "0"
            free = self.config.concurrency - len(self._inflight)
            if free <= 0:
                self._slot_freed.clear()
                await self._slot_freed.wait()
                continue
            try:
                async with asyncio.timeout(self.config.block_ms / 1000 + BLOCKING_SLACK_S):
                    reply: Any = await self._reader.xreadgroup(
                        self.group,
                        self.name,
                        {self.stream: cursor},
                        count=min(free, READ_BATCH),
                        block=None if cursor != ">" else self.config.block_ms,
                    )
                failures = 0
            except TRANSIENT_ERRORS as exc:  # includes TimeoutError (an OSError) from asyncio.timeout
                if self._stopping:
                    return
                failures += 1
                self.stats.reconnects += 1
                delay = backoff().compute(failures)
                log.warning(
                    "bus read failed; reconnecting", stream=self.stream, error=repr(exc), retry_in_s=round(delay, 3)
                )
                await asyncio.sleep(delay)
                cursor = "0"  # a reply may have been lost in flight: re-read our pending entries
                continue
            except ResponseError as exc:
                if not group_is_gone(exc):
                    raise
                log.warning("consumer group missing (Redis restarted?); recreating", stream=self.stream)
                await ensure_group(self.bus.redis, self.stream, self.group)
                cursor = "0"
                continue
            entries: list[tuple[bytes, dict[bytes, bytes] | None]] = reply[0][1] if reply else []
            if cursor == ">":
                for entry_id, fields in entries:
                    self._spawn(entry_id.decode(), fields, 1)
                continue
            if not entries:
                cursor = ">"
                continue
            cursor = entries[-1][0].decode()
            await self._spawn_redelivered(entries)

    async def _spawn_redelivered(self, entries: list[tuple[bytes, dict[bytes, bytes] | None]]) -> None:
        """Start handlers for entries delivered before (own pending, or reclaimed)."""
        mine = self._inflight.keys() | self._held.keys()
        fresh = [(i.decode(), f) for i, f in entries if i.decode() not in mine]
        if not fresh:
            return
        ids = [i for i, _ in fresh]
        counts = await delivery_counts(
            self.bus.redis, self.stream, self.group, self.name, ids, count=len(ids) + len(self._inflight) + 16
        )
        for entry_id, fields in fresh:
            self._spawn(entry_id, fields, counts.get(entry_id, 1))

    def _spawn(self, entry_id: str, fields: dict[bytes, bytes] | None, attempt: int) -> None:
        task = asyncio.create_task(self._handle(entry_id, fields, attempt), name=f"handle:{entry_id}")
        self._inflight[entry_id] = task
        self._started_at[entry_id] = time.monotonic()
        self.stats.in_flight = len(self._inflight)
        task.add_done_callback(functools.partial(self._done, entry_id))

    def _done(self, entry_id: str, _task: asyncio.Task[None]) -> None:
        self._inflight.pop(entry_id, None)
        self._started_at.pop(entry_id, None)
        self.stats.in_flight = len(self._inflight)
        self._slot_freed.set()

    # --- handling --------------------------------------------------------------------------

    async def _handle(self, entry_id: str, fields: dict[bytes, bytes] | None, attempt: int) -> None:
        t0 = time.perf_counter()
        if fields is None:
            # The entry was trimmed away while pending: there is nothing left to handle.
            log.warning(
                "pending entry was deleted from the stream before it was handled", stream=self.stream, id=entry_id
            )
            self._acks.add(entry_id)
            return
        raw = fields.get(FIELD)
        try:
            msg = decode(raw)
        except WireError as exc:
            await self._dead_letter(entry_id, raw, f"undecodable: {exc}", attempt)
            return
        if attempt > self.config.max_deliveries:
            # Delivered too often without an ack: e.g. it crashes every consumer that takes it.
            await self._dead_letter(entry_id, raw, f"gave up after {attempt - 1} deliveries without an ack", attempt)
            return
        try:
            outcome = await route(self._handlers, self.stream, msg)(Delivery(entry_id, self.stream, msg, attempt))
        except asyncio.CancelledError:
            raise  # left pending: redelivered after a restart or reclaimed by a peer
        except Reject as exc:
            self.stats.failed += 1
            await self._dead_letter(entry_id, raw, f"rejected: {exc}", attempt)
            return
        except Exception as exc:
            self.stats.failed += 1
            if attempt >= self.config.max_deliveries:
                await self._dead_letter(entry_id, raw, f"handler failed {attempt} times; last: {exc!r}", attempt)
            else:
                log.warning(
                    "handler failed; will retry",
                    stream=self.stream,
                    id=entry_id,
                    kind=kind_of(msg),
                    attempt=attempt,
                    error=repr(exc),
                    retry_after_ms=self.config.claim_idle_ms,
                )
            return
        self.stats.handled += 1
        if outcome is HOLD:
            self._held[entry_id] = time.monotonic()
            self.stats.held = len(self._held)
        else:
            self._acks.add(entry_id)
        if log.isEnabledFor(10):
            log.debug(
                "handled",
                stream=self.stream,
                id=entry_id,
                kind=kind_of(msg),
                attempt=attempt,
                ms=(time.perf_counter() - t0) * 1000,
            )

    async def _dead_letter(self, entry_id: str, raw: bytes | None, error: str, attempt: int) -> None:
        if await dead_letter(self.bus.redis, self.stream, self.group, self.name, entry_id, raw, error, attempt):
            self.stats.dead_lettered += 1

    # --- background loops ------------------------------------------------------------------

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
        while (free := self.config.concurrency - len(self._inflight)) > 0:
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
                await self._spawn_redelivered(claimed)
            start = next_start.decode() if isinstance(next_start, bytes) else next_start
            if start == "0-0":
                return


async def _cancel_and_wait(task: asyncio.Task[None] | None) -> None:
    if task is None:
        return
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
