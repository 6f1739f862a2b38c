"""A worker's way out: the ordered background outbox, and the cross-DC transfer it sends.

Every message a worker sends (tensors, bubble events, telemetry) goes through its `Outbox`, so
sending never delays the computation that follows (training is the owner), and messages leave in
the order they were sent.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence

from shared.bus import Bus
from shared.runtime.logs import get_logger
from shared.wire import Message, Transfer, encode

log = get_logger(__name__)

#: How long a closing outbox waits for the bus to take what is queued (a Redis restart takes about
#: a second; a Redis gone for good, for ever).
CLOSE_GRACE_S = 10.0


def wan_transfer(
    run: str,
    msg: Message,
    transfer_id: str,
    src_dc: str,
    dst_dc: str,
    deliver_to: str,
    priority: tuple[int, ...],
    nbytes: int,
) -> Transfer:
    """A cross-DC send as the broker takes it in WAN mode `model`: `nbytes` (the tensor's size on
    the data plane) go through the link model, and `msg` (the receiver's release) is delivered at
    the modelled arrival. Stamped now (`sent_at`): the emulated wire starts at the sender's send
    time, not one bus hop later when the broker reads it."""
    payload = encode(msg)
    return Transfer(
        run=run,
        transfer_id=transfer_id,
        src_dc=src_dc,
        dst_dc=dst_dc,
        nbytes=nbytes,
        priority=priority,
        deliver_to=deliver_to,
        payload=payload,
        sent_at=time.time(),
    )


class Outbox:
    """Publishes a worker's messages in order from a background task, so sending a tensor,
    announcing a bubble or flushing telemetry never delays the computation that follows
    (training is the owner). A publish failure surfaces at the next iteration boundary."""

    def __init__(self, bus: Bus) -> None:
        self.bus = bus
        self._queue: asyncio.Queue[tuple[str, list[Message], int | None]] = asyncio.Queue()
        self._task = asyncio.create_task(self._drain(), name="outbox")

    def send(self, stream: str, msg: Message) -> None:
        self._queue.put_nowait((stream, [msg], None))

    def send_many(self, stream: str, msgs: Sequence[Message], *, maxlen: int | None = None) -> None:
        self._queue.put_nowait((stream, list(msgs), maxlen))

    def raise_if_failed(self) -> None:
        if self._task.done() and not self._task.cancelled() and self._task.exception() is not None:
            raise RuntimeError("publishing to the bus failed") from self._task.exception()

    async def close(self, grace_s: float = CLOSE_GRACE_S) -> None:
        """Send everything queued, then stop. A bus that takes nothing for `grace_s` (its Redis died
        with the launcher, say: the publish rides the outage out, for ever) gets no more: what is
        left is dropped, saying how much, and the worker stops rather than wait for ever."""
        if not self._task.done():
            try:
                async with asyncio.timeout(grace_s):
                    await self._queue.join()
            except TimeoutError:
                left = self._queue.qsize() + 1  # and the one being published
                log.warning("messages not sent: the bus took none for the grace period", left=left, grace_s=grace_s)
        self._task.cancel()
        await asyncio.gather(self._task, return_exceptions=True)
        self.raise_if_failed()

    async def _drain(self) -> None:
        while True:
            stream, msgs, maxlen = await self._queue.get()
            try:
                if len(msgs) == 1 and maxlen is None:
                    await self.bus.publish(stream, msgs[0])
                else:
                    await self.bus.publish_many(stream, msgs, maxlen=maxlen)
            finally:
                self._queue.task_done()
