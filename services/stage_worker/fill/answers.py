"""A held batch's answering state: each request's answer goes as soon as it is done, whether its
batch goes on or not, one round trip at a time; the batch's delivery is acked once its answers and
its report are sent (`done`).

A run calls `Answers.callback`'s function from whichever thread runs it; the answer is queued on
the event loop before the run's own end is, so a report (the executor's `_finish`, after
`all_sent`) never overtakes an answer of its batch.

Tested by: tests/integration/test_fill_executor.py.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from services.stage_worker.fill.batch import Answered, Outcome

#: Sends answered outcomes (one round trip: `Reporter.answer`).
Send = Callable[[list[Outcome]], Awaitable[None]]


@dataclass
class Answers:
    """How a held batch's answers are getting out: those on their way, those waiting for them."""

    done: asyncio.Future[None]  # set once answered and reported: the delivery is acked then
    on_the_way: list[asyncio.Task[None]] = field(default_factory=list)  # answers on their way
    unsent: list[Outcome] = field(default_factory=list)  # answered, waiting for the answers on their way
    sending: asyncio.Task[None] | None = None  # the answers on their way, if any

    def callback(self, send: Send) -> Answered:
        """What a run calls with each outcome as it is answered, in the prefill thread or this loop:
        its answer is sent with `send` from this loop at once, or with the others answered
        meanwhile if an answer is on its way."""
        loop = asyncio.get_running_loop()

        def answered(o: Outcome) -> None:
            o.sent, o.answered_at = True, time.time()
            loop.call_soon_threadsafe(self._queue, o, send)

        return answered

    def _queue(self, o: Outcome, send: Send) -> None:
        self.unsent.append(o)
        if self.sending is None or self.sending.done():  # else the one sending takes it next
            self.sending = asyncio.create_task(self._send_unsent(send))
            self.on_the_way.append(self.sending)

    async def _send_unsent(self, send: Send) -> None:
        """Send the answers not sent yet, and those answered meanwhile, until none is left."""
        while self.unsent:
            sending, self.unsent = self.unsent, []
            await send(sending)

    async def all_sent(self) -> None:
        """Wait for every answer on its way (a send's error is raised here)."""
        if self.on_the_way:
            await asyncio.gather(*self.on_the_way)
