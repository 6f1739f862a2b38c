"""The dead-letter streams' records: what a consumer writes (with its ack, atomically) and what is read back.

A stream's dead letters go to the dead-letter stream of its hash tag (`keys.dead_letter_stream`: a
run's, ``bt:{<run>}:dead``, or ``bt:{<stream>}:dead`` for a stream with no tag), so the record and the source's
XACK are one MULTI on one slot of a Redis Cluster."""

from __future__ import annotations

import hashlib
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from redis.asyncio import Redis

from shared.bus.connection import TRANSIENT_ERRORS
from shared.runtime.logs import get_logger
from shared.wire import FIELD, keys

log = get_logger(__name__)


@dataclass(frozen=True, slots=True)
class DeadLetter:
    """An entry of the dead-letter stream: where a message came from and why it was given up."""

    id: str
    stream: str
    group: str
    source_id: str
    consumer: str
    attempts: int
    error: str
    #: The payload as stored: its first `keys.DEAD_LETTER_PAYLOAD_MAX_BYTES` bytes.
    payload: bytes
    #: The original payload's length and SHA-256, and whether `payload` is cut short of it.
    payload_bytes: int = 0
    payload_sha256: str = ""
    truncated: bool = False


#: What a consumer does with an entry before it dead-letters it (its raw payload, why): the stream's
#: owner answers what was owed on it (a request accepted and never answered otherwise).
LastWord = Callable[[bytes | None, str], Awaitable[None]]


async def dead_letter(
    r: Redis,
    stream: str,
    group: str,
    consumer: str,
    entry_id: str,
    raw: bytes | None,
    error: str,
    attempts: int,
    last_word: LastWord | None = None,
) -> bool:
    """Move `consumer`'s entry to its stream's dead-letter stream and ack it in its group, atomically
    (MULTI/EXEC): it is never both lost and acked; `last_word` first, if any. False if Redis could
    not be reached (by either): the entry then stays pending, to be retried. A last word that fails
    otherwise (a bug, a command refused) is logged and named in the record, and the entry moves on:
    left pending, it would fail the same way at every redelivery."""
    if last_word is not None:
        try:
            await last_word(raw, error)
        except TRANSIENT_ERRORS as exc:
            log.warning(
                "a dead letter's last word failed; it stays pending", stream=stream, id=entry_id, error=repr(exc)
            )
            return False
        except Exception as exc:  # a bug, or a command the server refuses: the entry must still move on
            log.error(
                "a dead letter's last word failed; dead-lettered without it",
                stream=stream,
                id=entry_id,
                error=repr(exc),
            )
            error = f"{error}; its last word failed: {exc!r}"
    record: dict[Any, Any] = {
        "stream": stream,
        "group": group,
        "id": entry_id,
        "consumer": consumer,
        "attempts": attempts,
        "error": error[: keys.DEAD_LETTER_ERROR_MAX_CHARS],
        **dead_letter_payload(raw or b""),
    }
    try:
        async with r.pipeline(transaction=True) as pipe:
            pipe.xadd(keys.dead_letter_stream(stream), record, maxlen=keys.DEAD_LETTER_MAXLEN, approximate=True)
            pipe.xack(stream, group, entry_id)
            await pipe.execute()
    except TRANSIENT_ERRORS as exc:
        log.warning(
            "dead-lettering failed; entry stays pending and will be retried",
            stream=stream,
            id=entry_id,
            error=repr(exc),
        )
        return False
    log.error("message dead-lettered", stream=stream, group=group, id=entry_id, attempt=attempts, error=error)
    return True


def dead_letter_payload(raw: bytes) -> dict[Any, Any]:
    """The payload fields of a dead letter: the payload itself up to
    `keys.DEAD_LETTER_PAYLOAD_MAX_BYTES` (its first bytes past that, with ``payload_truncated``
    set), its original length and SHA-256, so the stream's bytes are bounded (count x size) and a
    truncated payload can still be matched with the producer's copy."""
    cap = keys.DEAD_LETTER_PAYLOAD_MAX_BYTES
    return {
        FIELD: raw[:cap],
        "payload_bytes": len(raw),
        "payload_sha256": hashlib.sha256(raw).hexdigest(),
        "payload_truncated": int(len(raw) > cap),
    }


async def read_dead_letters(r: Redis, count: int, stream: str) -> list[DeadLetter]:
    """The oldest `count` entries of the dead-letter stream `stream` (a run's is
    `keys.run_dead_letter_stream`; every one matches `keys.DEAD_LETTER_PATTERN`)."""
    rows: Any = await r.xrange(stream, count=count)
    out = []
    for entry_id, f in rows:
        out.append(
            DeadLetter(
                id=entry_id.decode(),
                stream=f[b"stream"].decode(),
                group=f[b"group"].decode(),
                source_id=f[b"id"].decode(),
                consumer=f[b"consumer"].decode(),
                attempts=int(f[b"attempts"]),
                error=f[b"error"].decode(errors="replace"),
                payload=f.get(FIELD, b""),
                payload_bytes=int(f.get(b"payload_bytes", len(f.get(FIELD, b"")))),
                payload_sha256=f.get(b"payload_sha256", b"").decode(),
                truncated=f.get(b"payload_truncated", b"0") == b"1",
            )
        )
    return out
