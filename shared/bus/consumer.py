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
   **dead-letter stream** in one MULTI/EXEC with its XACK (never both lost and acked), after the
   owner's `last_word` on it (the dispatcher answers a request failed, `serving.fail_dead_request`).
5. While a handler runs longer than a quarter of ``claim_idle_ms``, the reclaim loop refreshes the
   entry's idle time (XCLAIM JUSTID, which does not count as a delivery), so a slow but live
   handler is not mistaken for a dead one; held entries are refreshed the same way, and so are
   entries whose effect is done but whose XACK Redis has not confirmed yet (they stay in hand
   until then, so no re-read of the consumer's own pending entries hands them out again).

**In order, in batches** (`sequential`): each read takes up to `READ_BATCH` entries and one task
hands them to their handlers one after another, in stream order; then the consumer's `after_read`
runs (the service's one flush of what the batch decided: its writes, and with them the entries'
XACK, in one round trip), and only then are the entries acked (if it did not). The next read
waits for that. A stream whose messages must not overtake each other (a bubble's end its start)
costs one round trip per batch, not per entry.

Connection loss (e.g. a Redis restart) never crashes the consumer: reads back off and reconnect,
the group is recreated if it vanished, unsent acks are kept and retried, and the own-pending pass
runs again. Shutdown (`stop`) stops reading, lets in-flight handlers finish within the grace
period, cancels the rest (they stay pending and are redelivered), flushes acks, then closes.

The read and handle loops are one state machine, so they stay together here. The entries in hand
(in flight or held) are an `InHand` (`in_hand.py`), which this consumer shares with the reclaim loop,
a `Reclaimer` it holds (`reclaim.py`). Beside them, what stands alone: `delivery.py` (handler
table), `acks.py` (batched acks), `deadletters.py`, `streams.py`.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import time
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass
from types import TracebackType
from typing import Any

from redis.asyncio.client import Pipeline
from redis.exceptions import ResponseError

from shared.bus.acks import Acks
from shared.bus.connection import (
    BLOCKING_SLACK_S,
    TRANSIENT_ERRORS,
    Connected,
    backoff,
    blocking_client,
    is_cluster,
    node_of,
)
from shared.bus.deadletters import LastWord, dead_letter
from shared.bus.delivery import HOLD, Delivery, Handlers, Reject, route
from shared.bus.in_hand import InHand
from shared.bus.reclaim import READ_BATCH, Entries, Reclaimer
from shared.bus.streams import delivery_counts, ensure_group, group_is_gone
from shared.bus.unblock import end_blocking_read
from shared.config.spec import BusConfig
from shared.runtime.logs import get_logger
from shared.wire import FIELD, WireError, decode, kind_of

log = get_logger(__name__)


@dataclass
class ConsumerStats:
    handled: int = 0
    failed: int = 0
    dead_lettered: int = 0
    reclaimed: int = 0
    reconnects: int = 0
    in_flight: int = 0
    held: int = 0


#: What a sequential consumer runs after each read's entries were handled, given the ids to ack
#: (those whose effect is done): it returns True when it acked them itself, in the same round trip
#: as the effects it wrote (`ack_on`), else the consumer acks them.
AfterRead = Callable[[list[str]], Awaitable[bool]]
#: Awaited before entries read or reclaimed are handled: raises where this consumer may no longer
#: handle its stream's entries (a stage worker whose slot may be another's: `SlotLease.fence`).
Fence = Callable[[], Awaitable[None]]


class Consumer:
    def __init__(
        self,
        bus: Connected,
        stream: str,
        group: str,
        handlers: Handlers,
        *,
        name: str,
        config: BusConfig,
        sequential: bool = False,
        after_read: AfterRead | None = None,
        last_word: LastWord | None = None,
        fence: Fence | None = None,
    ) -> None:
        self.bus, self.sequential, self._fence = bus, sequential, fence
        self._after_read, self._last_word = after_read, last_word
        self.stream, self.group, self.name, self.config = stream, group, name, config
        self.stats = ConsumerStats()
        if not handlers:
            raise ValueError(f"a consumer of {stream} needs a handler table with at least one message kind")
        self._handlers = dict(handlers)
        self._reader_name = f"reader-{name}"
        self._reader = blocking_client(bus.url, name=self._reader_name)
        self._reading = False  # a read is under way (sent, or blocked on the server)
        #: Entries in flight, and those whose handler returned HOLD (pending, ours, refreshed, until `release`).
        self._in_hand = InHand(sequential=sequential, slots=1 if sequential else config.concurrency)
        self._slot_freed = asyncio.Event()
        self._acks = Acks(bus, stream, group, self._in_hand)
        self._stopping = False
        self._read_task = self._reclaim_task = self._ack_task = None  # type: asyncio.Task[None] | None
        self._resync = asyncio.Event()  # set when the own-pending pass must run again
        self._reclaimer = Reclaimer(bus, stream, group, name, config, self._in_hand, self._take_over, self._resync)
        #: Set if a background loop died of an unexpected error; services watch it and exit.
        self.crashed = asyncio.Event()
        self.error: BaseException | None = None

    # --- lifecycle -------------------------------------------------------------------------

    async def start(self) -> Consumer:
        await ensure_group(self.bus.redis, self.stream, self.group)
        self._read_task = asyncio.create_task(self._read_loop(), name=f"read:{self.stream}")
        self._reclaim_task = asyncio.create_task(self._reclaimer.run(), name=f"reclaim:{self.stream}")
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
        if self._reading and self._read_task is not None:
            await end_blocking_read(self.bus.redis, self._reader_name, self._read_task, self.stream)
        await _cancel_and_wait(self._read_task)
        pending: set[asyncio.Task[object]] = set()
        if tasks := self._in_hand.tasks():
            _, pending = await asyncio.wait(tasks, timeout=grace)
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

    def resync(self) -> None:
        """Re-read this consumer's own pending entries at its next read: entries someone moved to
        it (`shared.bus.streams.claim_strays`) are handled then; those in hand are not again."""
        self._resync.set()

    def ack_on(self, pipe: Pipeline, ids: list[str]) -> None:
        """Queue the XACK of `ids` on the caller's pipeline, after the effects it carries: the
        entries of the read being handled (`AfterRead`), or held ones whose effect is done (then
        `forget_held` them once the pipeline ran)."""
        if ids:
            pipe.xack(self.stream, self.group, *ids)

    def forget_held(self, ids: list[str]) -> None:
        """Held entries the caller acked itself (`ack_on`): no longer held here."""
        for entry_id in ids:
            self._in_hand.release(entry_id)
        self.stats.held = self._in_hand.held

    def release_all(self, ids: list[str]) -> None:
        """`release` each of `ids`."""
        for entry_id in ids:
            self.release(entry_id)

    def release(self, entry_id: str) -> None:
        """Ack an entry its handler held (`HOLD`): its effect has now happened. Unknown ids (already
        released, or held by a previous incarnation) are acked too: acking is idempotent."""
        self._acks.add(entry_id)  # first: in hand as acking since it was held
        self._in_hand.release(entry_id)
        self.stats.held = self._in_hand.held

    # --- reading ---------------------------------------------------------------------------

    async def _read(self, cursor: str, free: int) -> Any:
        """One XREADGROUP, blocking for new entries; `_reading` while it is under way (`stop` then
        ends it on the server too: `end_blocking_read`)."""
        self._reading = True
        count = READ_BATCH if self.sequential else min(free, READ_BATCH)
        block = None if cursor != ">" else self.config.block_ms
        try:
            async with asyncio.timeout(self.config.block_ms / 1000 + BLOCKING_SLACK_S):
                if not is_cluster(self._reader):
                    return await self._reader.xreadgroup(self.group, self.name, {self.stream: cursor}, count, block)
                # On a cluster, sent to the stream's node: redis-py cannot read XREADGROUP's keys
                # from its key spec (a keyword search) and asked the server (COMMAND GETKEYS) before
                # every read, 14% of a dispatcher's CPU. The slot map is the client's own, refreshed
                # as its commands do (`initialize`: at once the first time, then when an error asked
                # for it: a failover), and a MOVED is still followed.
                await self._reader.initialize()
                node = node_of(self._reader, self.stream)
                blocking = () if block is None else ("BLOCK", block)
                args = ("GROUP", self.group, self.name, "COUNT", count, *blocking, "STREAMS", self.stream, cursor)
                return await self._reader.execute_command("XREADGROUP", *args, target_nodes=node)
        finally:
            self._reading = False

    async def _read_loop(self) -> None:
        cursor = "0"  # "0": our own pending entries first; ">": new entries
        failures = 0
        while not self._stopping:
            if self._resync.is_set():
                self._resync.clear()
                cursor = "0"
            free = self._in_hand.free()
            if free <= 0:
                self._slot_freed.clear()
                await self._slot_freed.wait()
                continue
            try:
                cursor = await self._read_and_hand_out(cursor, free)
                failures = 0
            except TRANSIENT_ERRORS as exc:  # the read, or a call after it (the fence, the delivery counts)
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
            except ResponseError as exc:
                if not group_is_gone(exc):
                    raise
                log.warning("consumer group missing (Redis restarted?); recreating", stream=self.stream)
                cursor = "0"
                with contextlib.suppress(*TRANSIENT_ERRORS):  # else the next read fails, and backs off
                    await ensure_group(self.bus.redis, self.stream, self.group)

    async def _read_and_hand_out(self, cursor: str, free: int) -> str:
        """One read at `cursor` and its entries handed to handlers; the next cursor. Every Redis call
        here (the read, the fence, the delivery counts of entries read again) may fail on the
        connection (a master's failover): the loop then backs off and re-reads its own pending."""
        reply = await self._read(cursor, free)
        entries: list[tuple[bytes, dict[bytes, bytes] | None]] = reply[0][1] if reply else []
        if entries and self._fence is not None:
            await self._fence()  # a stale reader (its slot another's) must not handle them
        if cursor == ">":
            self._spawn_all([(i.decode(), f, 1) for i, f in entries])
            return ">"
        if not entries:
            return ">"
        await self._spawn_redelivered(entries)
        return entries[-1][0].decode()

    async def _take_over(self, claimed: Entries) -> None:
        """Handle entries the reclaim loop took over from the group (idle too long elsewhere)."""
        self.stats.reclaimed += len(claimed)
        log.info("reclaimed idle entries", stream=self.stream, count=len(claimed), first=claimed[0][0].decode())
        if self._fence is not None:
            await self._fence()
        await self._spawn_redelivered(claimed)

    async def _spawn_redelivered(self, entries: Entries) -> None:
        """Start handlers for entries delivered before (own pending, or reclaimed)."""
        fresh = [(i.decode(), f) for i, f in entries if i.decode() not in self._in_hand]
        if not fresh:
            return
        ids = [i for i, _ in fresh]
        counts = await delivery_counts(
            self.bus.redis, self.stream, self.group, self.name, ids, count=len(ids) + self._in_hand.in_flight + 16
        )
        self._spawn_all([(entry_id, fields, counts.get(entry_id, 1)) for entry_id, fields in fresh])

    def _spawn_all(self, entries: list[tuple[str, dict[bytes, bytes] | None, int]]) -> None:
        """Handlers for `entries` (id, fields, attempt): a task each, or one for them all, in
        order, when the consumer is `sequential`."""
        if not entries:
            return
        if not self.sequential:
            for entry in entries:
                self._track([entry[0]], self._handle(*entry))
            return
        self._track([e[0] for e in entries], self._handle_in_order(entries))

    def _track(self, ids: list[str], work: Coroutine[Any, Any, object]) -> None:
        task = asyncio.create_task(work, name=f"handle:{ids[0]}")
        self._in_hand.track(ids, task, time.monotonic())
        self.stats.in_flight = self._in_hand.in_flight
        task.add_done_callback(functools.partial(self._done, ids))

    def _done(self, ids: list[str], _task: asyncio.Task[object]) -> None:
        self._in_hand.handled(ids)
        self.stats.in_flight = self._in_hand.in_flight
        self._slot_freed.set()

    async def _handle_in_order(self, entries: list[tuple[str, dict[bytes, bytes] | None, int]]) -> None:
        """A sequential consumer's batch: each entry handled in turn, then `after_read`, then the
        acks of those whose effect is done (held ones stay pending, as with one task each)."""
        done = [
            entry_id
            for entry_id, fields, attempt in entries
            if await self._handle(entry_id, fields, attempt, ack=False)
        ]
        if self._after_read is not None and await self._after_read(done):
            return
        for entry_id in done:
            self._acks.add(entry_id)

    # --- handling --------------------------------------------------------------------------

    async def _handle(
        self, entry_id: str, fields: dict[bytes, bytes] | None, attempt: int, *, ack: bool = True
    ) -> bool:
        """Handle one entry. Returns whether it is to be acked (its effect happened); with `ack`
        the ack is queued here, else it is the caller's. Dead letters are acked with their record."""
        t0 = time.perf_counter()
        if fields is None:
            # The entry was trimmed away while pending: there is nothing left to handle.
            log.warning(
                "pending entry was deleted from the stream before it was handled", stream=self.stream, id=entry_id
            )
            return self._done_with(entry_id, ack)
        raw = fields.get(FIELD)
        try:
            msg = decode(raw)
        except WireError as exc:
            await self._dead_letter(entry_id, raw, f"undecodable: {exc}", attempt)
            return False
        if attempt > self.config.max_deliveries:
            # Delivered too often without an ack: e.g. it crashes every consumer that takes it.
            await self._dead_letter(entry_id, raw, f"gave up after {attempt - 1} deliveries without an ack", attempt)
            return False
        try:
            outcome = await route(self._handlers, self.stream, msg)(Delivery(entry_id, self.stream, msg, attempt))
        except asyncio.CancelledError:
            raise  # left pending: redelivered after a restart or reclaimed by a peer
        except Reject as exc:
            self.stats.failed += 1
            await self._dead_letter(entry_id, raw, f"rejected: {exc}", attempt)
            return False
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
            return False
        self.stats.handled += 1
        if log.isEnabledFor(10):
            log.debug(
                "handled",
                stream=self.stream,
                id=entry_id,
                kind=kind_of(msg),
                attempt=attempt,
                ms=(time.perf_counter() - t0) * 1000,
            )
        if outcome is HOLD:
            self._in_hand.hold(entry_id, time.monotonic())
            self.stats.held = self._in_hand.held
            return False
        return self._done_with(entry_id, ack)

    def _done_with(self, entry_id: str, ack: bool) -> bool:
        if ack:
            self._acks.add(entry_id)
        return True

    async def _dead_letter(self, entry_id: str, raw: bytes | None, error: str, attempt: int) -> None:
        args = (self.bus.redis, self.stream, self.group, self.name, entry_id, raw, error, attempt, self._last_word)
        if await dead_letter(*args):  # not `+= await ...`: that reads the count before the await
            self.stats.dead_lettered += 1


async def _cancel_and_wait(task: asyncio.Task[None] | None) -> None:
    if task is None or task.done():  # one that crashed: its error is `Consumer.error` already
        return
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
