"""Ending a consumer's blocking read on the server, not only in this process.

A blocked XREADGROUP cancelled here stays blocked on the server until the server notices the
connection gone. An entry added meanwhile is handed to it: into the stopped consumer's pending
list, where it waits `claim_idle_ms` for another consumer to claim it. So a stopping consumer whose
read is under way first asks the server to end it (CLIENT UNBLOCK, the reader found by its client
name in CLIENT LIST). The read returns empty, and the loop, seeing it is stopping, ends.

On a Redis Cluster both commands go to the node holding the stream (`node_of`), which is where
the read blocks (a client id is a node's own: the same id on another node is another client).

Where the server refuses CLIENT LIST or UNBLOCK (an ACL), or does not answer, the cancel alone
remains, as before.

Tested by: tests/integration/test_bus.py.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

from redis.exceptions import ResponseError

from shared.bus.connection import TRANSIENT_ERRORS, Client, node_of

#: Looks at the server: a read sent just before the stop may reach it after the first look.
TRIES = 4
#: Between looks, the read loop is given this long to end.
WAIT_S = 0.05
#: The most a stop waits on this (Redis gone: the cancel alone).
BOUND_S = 0.5


async def end_blocking_read(redis: Client, reader_name: str, read: asyncio.Task[None], stream: str) -> bool:
    """Unblock the reader's read of `stream` on the server until the read loop `read` ends;
    whether it did (if not, the caller cancels it)."""
    node = node_of(redis, stream)
    target: dict[str, Any] = {} if node is None else {"target_nodes": node}
    with contextlib.suppress(TimeoutError, ResponseError, *TRANSIENT_ERRORS):
        async with asyncio.timeout(BOUND_S):
            for _ in range(TRIES):
                for client in await redis.client_list(_type="normal", **target):
                    if client.get("name") == reader_name and "b" in client.get("flags", ""):
                        await redis.client_unblock(int(client["id"]), **target)
                await asyncio.wait({read}, timeout=WAIT_S)
                if read.done():
                    break
    return read.done()
