"""The worker's mailbox: a tensor arrives when the transport has it (`landed`, from the receive's
own thread), not when the event loop gets round to `put` it; a bubble's overrun is timed from then."""

from __future__ import annotations

import asyncio
import threading

import pytest

from services.stage_worker.port.mailbox import Mailbox
from services.stage_worker.port.tensors import Direction, TensorKey

KEY = TensorKey(Direction.GRAD, 3, 1)


async def test_a_tensor_that_landed_in_another_thread_has_arrived_before_the_loop_puts_it() -> None:
    box = Mailbox()
    t = threading.Thread(target=box.landed, args=(KEY, 100.0))
    t.start()
    t.join()
    assert box.arrived(KEY) and box.arrived_at(KEY) == 100.0 and not box.ready(KEY)
    box.put(KEY, "tensor")  # the loop, later: the arrival keeps the receive's time
    assert box.arrived_at(KEY) == 100.0 and box.ready(KEY)
    assert await box.take(KEY) == "tensor" and box.arrived(KEY)


async def test_put_alone_stamps_its_own_time_and_a_waiter_gets_the_tensor() -> None:
    box = Mailbox()
    waiter = asyncio.ensure_future(box.take(KEY))
    await asyncio.sleep(0)
    assert not box.arrived(KEY) and box.arrived_at(KEY) is None
    box.put(KEY, "tensor")
    assert await waiter == "tensor" and box.arrived(KEY) and box.arrived_at(KEY) is not None


@pytest.mark.parametrize("forget", ["reset", "forget_before"])
def test_a_landed_mark_is_forgotten_with_the_rest(forget: str) -> None:
    box = Mailbox()
    box.landed(KEY, 1.0)
    if forget == "reset":
        box.reset()
    else:
        box.forget_before(lambda k: k[1] >= 4)  # iterations before 4 are over
    assert not box.arrived(KEY) and box.arrived_at(KEY) is None
