"""A data-plane formation called off ends at once, against a real redis-server and real gloo.

A worker whose run stops while it waits for its peers to form a generation's groups (they are
stopping too) calls the formation off; without that, the thread forming the groups waited out the
plane's timeout (60 s) and held the worker's exit that long: a Ctrl-C of `bubbletea train` just as
its workers formed took 15 s a worker, until the launcher killed them."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from shared.dataplane import DataPlane, PairSpec, PlaneError


async def test_a_formation_whose_peer_never_comes_ends_when_called_off(redis_url: str) -> None:
    plane = DataPlane(redis_url, "calloff", ["127.0.0.1"], timeout_s=60.0)
    pair = PairSpec(peer="r0s1", key="r0:s0-s1", rank=0, connections=2)  # the peer never forms its end
    called_off = threading.Event()
    t0 = time.monotonic()
    forming = asyncio.ensure_future(asyncio.to_thread(plane.form, 1, [pair], None, (), called_off))
    await asyncio.sleep(0.3)
    assert not forming.done()  # waiting for the peer
    called_off.set()
    with pytest.raises(PlaneError, match="called off"):
        await asyncio.wait_for(forming, 10)
    assert time.monotonic() - t0 < 5  # not the plane's 60 s timeout
    assert plane.generation is None  # nothing formed
