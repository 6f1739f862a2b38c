"""A run's dispatchers watched from outside, through Redis alone (`fault_arms.DispatcherKill`): who
holds the dispatcher lease after its leader was killed, the first batch sent after a moment, and
a live dispatcher standing by.

Each reads what the services write anyway: the lease's value (`keys.dispatcher_lease_key`), the
fill streams (`keys.fill_stream`) and the heartbeats (`shared.control.health`)."""

from __future__ import annotations

import asyncio
import os
import time
from typing import Any

from shared.bus.streams import parse_id
from shared.control.health import live_instances
from shared.wire import FIELD, PrefillBatch, decode, keys

#: How long a killed dispatcher's lease may stay with it, and its successor take to send a batch,
#: before the kill counts as never taken over / never served (infinite in the figures).
TAKEOVER_TIMEOUT_S = 30.0
#: How often the lease is looked at after a kill (its holder's change has no event to wait on).
LEASE_POLL_S = 0.01
#: The largest sequence number of a stream entry id: `<ms - 1>-MAX_SEQ` reads from `ms` on.
MAX_SEQ = 2**64 - 1


async def lease_moved(r: Any, run: str, leader: str, at: float, held_last: float | None) -> dict[str, Any]:
    """Watch the run's dispatcher lease after `leader` was killed at `at`: when it was last seen
    with it (`held_last`, a look's send time; at least `at`, and at least the `held_last` given:
    a release's), first seen without it (`gone_s`) and first seen with another (`takeover_s`,
    None: not within `TAKEOVER_TIMEOUT_S`), and who (`new_leader`)."""
    key = keys.dispatcher_lease_key(run)
    last = max(at, held_last or at)
    gone = None
    deadline = time.monotonic() + TAKEOVER_TIMEOUT_S
    while time.monotonic() < deadline:
        sent = time.time()
        holder = (await r.get(key) or b"").decode()
        if holder == leader:
            last = sent
        else:
            gone = gone if gone is not None else sent
            if holder:
                took = {"takeover_s": round(sent - at, 3), "new_leader": holder}
                return {"held_last": last, "gone_s": round(gone - at, 3)} | took
        await asyncio.sleep(LEASE_POLL_S)  # a key's value: there is no event to wait on
    gone_s = round(gone - at, 3) if gone is not None else None
    return {"held_last": last, "gone_s": gone_s, "takeover_s": None, "new_leader": None}


async def first_batch(r: Any, run: str, pp: int, dp: int, since: float, at: float) -> dict[str, Any]:
    """The first PrefillBatch appended to any of the run's fill streams at or after `since` (wall
    clock), timed from `at` by its entry id (Redis's clock: this host's); `serving_s` None: none
    within `TAKEOVER_TIMEOUT_S`."""
    start = f"{int(since * 1000) - 1}-{MAX_SEQ}"
    last = {keys.fill_stream(run, d, k): start for d in range(dp) for k in range(pp)}
    deadline = time.monotonic() + TAKEOVER_TIMEOUT_S
    while (left := deadline - time.monotonic()) > 0:
        got: Any = await r.xread(last, block=max(1, int(min(left, 1.0) * 1000)))
        found = []
        for stream, entries in got or []:
            name = stream.decode() if isinstance(stream, bytes) else stream
            for entry_id, fields in entries:
                last[name] = entry_id
                if isinstance(m := decode(fields[FIELD]), PrefillBatch):
                    found.append((parse_id(entry_id), m))
        if found:
            (ms, _), batch = min(found, key=lambda f: f[0])
            return {"serving_s": round(ms / 1000 - at, 3), "first_batch": batch.batch_id, "to": batch.worker}
    return {"serving_s": None, "first_batch": None, "to": None}


async def standby(r: Any, run: str, killed: int | None, timeout_s: float = 60.0) -> int | None:
    """The PID of a live dispatcher of this host standing by (its heartbeat says so, and the lease
    is another's), not `killed`; None if there is none within `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while True:
        leader = (await r.get(keys.dispatcher_lease_key(run)) or b"").decode()
        leads = leader.rpartition("-")[2]
        for inst in await live_instances(r, "dispatcher"):
            pid = int(inst["pid"])  # (a heartbeat a beat old may say "standby" of the new leader)
            if inst.get("role") == "standby" and leads.isdigit() and pid not in (killed, int(leads)) and alive(pid):
                return pid
        if time.monotonic() >= deadline:
            return None
        await asyncio.sleep(0.2)  # heartbeats are TTL keys: nothing to wait on but time


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True
