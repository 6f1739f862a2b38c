"""A consumer's batched acks: one XACK per wake-up, kept and retried through a lost connection.

A wake-up waits `GATHER_S` before it sends: the acks of the entries handled meanwhile (a busy
consumer handles hundreds a second) share the round trip. An ack only tells Redis the effect
happened; sent a moment later, a crash in between redelivers entries whose handlers are idempotent.
Until Redis confirms an XACK its entries stay in the consumer's `InHand` (`acking`): neither its
own re-read of its pending entries nor its reclaim pass hands them to a handler again, and the
reclaim loop keeps them from a peer."""

from __future__ import annotations

import asyncio
import time

from shared.bus.connection import TRANSIENT_ERRORS, Connected, backoff
from shared.bus.in_hand import InHand
from shared.runtime.logs import get_logger

log = get_logger(__name__)

#: How long a wake-up gathers acks before sending them (host time).
GATHER_S = 0.002


class Acks:
    """Entry ids whose effects happened, waiting for their XACK. `run` sends them, many per round
    trip under load; after `close` it sends what is left and returns."""

    def __init__(self, bus: Connected, stream: str, group: str, in_hand: InHand) -> None:
        self.bus = bus
        self.stream = stream
        self.group = group
        self.in_hand = in_hand
        self._unsent: list[str] = []
        self._wakeup = asyncio.Event()
        self._closing = False

    def __len__(self) -> int:
        """How many acks are not sent yet."""
        return len(self._unsent)

    def add(self, entry_id: str) -> None:
        self.in_hand.acking(entry_id, time.monotonic())
        self._unsent.append(entry_id)
        self._wakeup.set()

    def close(self) -> None:
        """`run` returns once every ack queued so far is sent."""
        self._closing = True
        self._wakeup.set()

    async def run(self) -> None:
        failures = 0
        while True:
            await self._wakeup.wait()
            if not self._closing:
                await asyncio.sleep(GATHER_S)  # the acks of what is handled meanwhile go with these
            self._wakeup.clear()
            while self._unsent:
                ids, self._unsent = self._unsent, []
                try:
                    await self.bus.redis.xack(self.stream, self.group, *ids)
                    self.in_hand.acked(ids)
                    failures = 0
                except TRANSIENT_ERRORS as exc:
                    self._unsent[:0] = ids  # keep them: the effects happened, the acks must follow
                    failures += 1
                    log.warning(
                        "ack failed; retrying", stream=self.stream, pending_acks=len(self._unsent), error=repr(exc)
                    )
                    await asyncio.sleep(backoff().compute(failures))
            if self._closing:
                return
