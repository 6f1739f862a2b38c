"""Stream bookkeeping: consumer groups, entry ids, delivery counts, and trimming that never drops unread work."""

from __future__ import annotations

from typing import Any

from redis.asyncio import Redis
from redis.exceptions import ResponseError

from shared.runtime.logs import get_logger

log = get_logger(__name__)


def parse_id(entry_id: bytes | str) -> tuple[int, int]:
    """``b"1700000000000-3"`` -> ``(1700000000000, 3)``; ids compare as such tuples."""
    text = entry_id.decode() if isinstance(entry_id, bytes) else entry_id
    ms, _, seq = text.partition("-")
    return int(ms), int(seq or 0)


def format_id(ms: int, seq: int) -> str:
    return f"{ms}-{seq}"


async def ensure_group(r: Redis, stream: str, group: str) -> None:
    """Create the group (and the stream) if missing. The group starts at the stream's beginning,
    so work published before any consumer existed is still delivered."""
    try:
        await r.xgroup_create(stream, group, id="0", mkstream=True)
        log.info("consumer group created", stream=stream, group=group)
    except ResponseError as exc:
        if "BUSYGROUP" not in str(exc):
            raise


def group_is_gone(exc: BaseException) -> bool:
    """The group (or its stream) vanished, e.g. a Redis restart without persistence.

    NOGROUP answers a read of a missing group; UNBLOCKED answers a blocked reader whose stream
    was deleted under it (Redis 7).
    """
    return isinstance(exc, ResponseError) and str(exc).startswith(("NOGROUP", "UNBLOCKED"))


async def safe_trim_point(r: Redis, stream: str) -> tuple[int, int] | None:
    """The oldest entry id some group still needs, or None when nothing can be trimmed safely.

    An entry is still needed if it is pending (delivered, not acked) in some group, or not yet
    delivered to some group (newer than that group's last-delivered id). A stream with no group
    is never trimmed this way: nobody has said what they have read.
    """
    try:
        groups = await r.xinfo_groups(stream)
    except ResponseError:
        return None  # no such stream
    if not groups:
        return None
    needed: list[tuple[int, int]] = []
    for g in groups:
        ms, seq = parse_id(g["last-delivered-id"])
        needed.append((ms, seq + 1))
        if g["pending"]:
            summary = await r.xpending(stream, g["name"])
            # XINFO and XPENDING are two calls: the entries may have been acked in between.
            if summary["min"] is not None:
                needed.append(parse_id(summary["min"]))
    return min(needed)


async def trim_acked(r: Redis, stream: str, *, soft_max_len: int) -> int:
    """Trim entries every group has acked; warn (never drop) when the unread backlog is too long.

    Returns the number of entries removed.
    """
    point = await safe_trim_point(r, stream)
    removed = 0
    if point is not None:
        removed = int(await r.xtrim(stream, minid=format_id(*point), approximate=False))
    length = int(await r.xlen(stream))
    if length > soft_max_len:
        log.warning(
            "stream backlog over its bound; unread entries are kept, not dropped",
            stream=stream,
            length=length,
            bound=soft_max_len,
        )
    return removed


async def delivery_counts(
    r: Redis, stream: str, group: str, consumer: str, ids: list[str], *, count: int
) -> dict[str, int]:
    """How often each of `consumer`'s pending entries from ``ids[0]`` to ``ids[-1]`` (at most
    `count` of them) was delivered: entry id -> times delivered."""
    rows: Any = await r.xpending_range(stream, group, min=ids[0], max=ids[-1], count=count, consumername=consumer)
    return {row["message_id"].decode(): int(row["times_delivered"]) for row in rows}


# XAUTOCLAIM JUSTID by script: redis-py's reply parser keeps only the ids, not the cursor to go on from.
_CLAIM_ALL = "return redis.call('XAUTOCLAIM', KEYS[1], ARGV[1], ARGV[2], 0, ARGV[3], 'COUNT', ARGV[4], 'JUSTID')"


async def claim_strays(r: Redis, stream: str, group: str, consumer: str) -> dict[str, int]:
    """Move to `consumer` the entries pending in `group` on any other consumer (XCLAIM JUSTID, min
    idle 0: not a delivery), leaving its own alone: for the one consumer a lease says may read the
    group, when another (fenced, deposed) read entries after it took over. Returns how many moved,
    by whom they were pending on; one XPENDING when there are none."""
    summary: Any = await r.xpending(stream, group)
    moved: dict[str, int] = {}
    for row in summary.get("consumers") or []:
        name = row["name"].decode() if isinstance(row["name"], bytes) else str(row["name"])
        if name == consumer or not int(row["pending"]):
            continue
        rows: Any = await r.xpending_range(stream, group, "-", "+", int(row["pending"]), consumername=name)
        ids = [x["message_id"] for x in rows]
        if ids:
            await r.xclaim(stream, group, consumer, min_idle_time=0, message_ids=ids, justid=True)
            moved[name] = len(ids)
    return moved


async def claim_all(r: Redis, stream: str, group: str, consumer: str, *, count: int = 1_000) -> int:
    """Move every entry pending in `group` to `consumer` now, whoever holds it and however briefly
    idle (XAUTOCLAIM JUSTID from 0): for a consumer that knows the group's others are gone or
    fenced (a dispatcher that took its run's lease). Its next own-pending read delivers them
    (counted as delivered again). Returns how many it moved."""
    await ensure_group(r, stream, group)
    start, moved = "0-0", 0
    while True:
        reply: Any = await r.eval(_CLAIM_ALL, 1, stream, group, consumer, start, count)
        moved += len(reply[1])
        start = reply[0].decode() if isinstance(reply[0], bytes) else str(reply[0])
        if start == "0-0":
            return moved
