"""A decode service's end of the KV data plane: `KvClient`, one kept connection per holder
(`shared.dataplane.kv` has the protocol, "bubbletea-kv-wire/1", and the holder's side).
"""

from __future__ import annotations

import asyncio
import contextlib

from shared.dataplane.kv import (
    BAD_REQUEST,
    KV_FETCH_TIMEOUT_S,
    MAGIC,
    MAX_ID_BYTES,
    NOT_HELD,
    OK,
    OP_FETCH,
    OP_FREE,
    PROTOCOL,
    READ_LIMIT,
    REQUEST,
    RESPONSE,
    parse_holder,
    tcp_keepalive,
)


class _ProtocolError(Exception):
    """The holder answered something that is not `PROTOCOL`."""


class _Connection:
    """One kept connection to one holder; `lock` makes requests take turns on it."""

    def __init__(self) -> None:
        self.lock = asyncio.Lock()
        self.users = 0  # requests using or waiting for it
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None

    @property
    def usable(self) -> bool:
        return self.writer is not None and self.reader is not None and not self.reader.at_eof()

    async def open(self, host: str, port: int) -> None:
        self.reader, self.writer = await asyncio.open_connection(host, port, limit=READ_LIMIT)
        tcp_keepalive(self.writer)

    def drop(self) -> None:
        if self.writer is not None:
            self.writer.close()
        self.reader = self.writer = None

    async def ask(self, request: bytes) -> tuple[int, bytes]:
        assert self.reader is not None and self.writer is not None
        try:
            self.writer.write(request)
            await self.writer.drain()
            magic, status, length = RESPONSE.unpack(await self.reader.readexactly(RESPONSE.size))
            if magic != MAGIC or status not in (OK, NOT_HELD, BAD_REQUEST):
                raise _ProtocolError(f"a response starting {magic!r} with status {status}")
            body = await self.reader.readexactly(length) if length else b""
        except BaseException:  # the stream's position is unknown (a timeout, a lost connection): never reuse it
            self.drop()
            raise
        if status == BAD_REQUEST:
            self.drop()  # the server closes it
        return status, body


class KvClient:
    """A decode service's end: one kept connection per holder (module docstring)."""

    def __init__(self) -> None:
        self._connections: dict[str, _Connection] = {}
        self.connects = 0  # connections opened

    async def fetch(
        self, holder: str, request_id: str, timeout_s: float = KV_FETCH_TIMEOUT_S
    ) -> tuple[bytes | None, str]:
        """The KV cache bytes of `request_id` from `holder`, or None and why not."""
        status, body, why = await self._ask(holder, OP_FETCH, request_id, timeout_s)
        if why:
            return None, why
        if status == OK:
            return body, ""
        text = body.decode(errors="replace")
        if status == NOT_HELD:
            return None, f"no KV cache for {request_id} on {holder}: {text}"
        return None, f"the worker holding the KV cache of {request_id} ({holder}) refused the request: {text}"

    async def free(self, holder: str, request_id: str, timeout_s: float = KV_FETCH_TIMEOUT_S) -> tuple[bool, str]:
        """Drop the KV cache of `request_id` on `holder`: whether it was held there, and if not why."""
        status, body, why = await self._ask(holder, OP_FREE, request_id, timeout_s)
        if why:
            return False, why
        if status == OK:
            return True, ""
        return False, f"no KV cache for {request_id} on {holder} to free: {body.decode(errors='replace')}"

    async def _ask(self, holder: str, op: int, rid: str, timeout_s: float) -> tuple[int, bytes, str]:
        """(status, body, "") or (-1, b"", why the holder gave no answer)."""
        who = f"the worker holding the KV cache of {rid} ({holder})"
        try:
            host, port = parse_holder(holder)
        except ValueError as exc:
            return -1, b"", f"cannot reach {who}: {exc}"
        raw = rid.encode()
        if len(raw) > MAX_ID_BYTES:
            return -1, b"", f"the request id {rid[:40]!r}... is {len(raw)} bytes: at most {MAX_ID_BYTES}"
        request = REQUEST.pack(MAGIC, op, len(raw)) + raw
        conn = self._connections.setdefault(holder, _Connection())
        conn.users += 1
        try:
            async with asyncio.timeout(timeout_s):
                async with conn.lock:
                    status, body = await self._exchange(conn, host, port, request)
            return status, body, ""
        except TimeoutError:
            return -1, b"", f"{who} did not answer within {timeout_s:g} s"
        except ConnectionRefusedError:
            return -1, b"", f"{who} is gone: connection refused"
        except asyncio.IncompleteReadError:
            return -1, b"", f"{who} is gone: it closed the connection before answering"
        except OSError as exc:
            return -1, b"", f"{who} is gone: {exc.strerror or exc}"
        except _ProtocolError as exc:
            return -1, b"", f"{who} did not answer in {PROTOCOL}: {exc}"
        finally:
            conn.users -= 1
            if not conn.users and not conn.usable and self._connections.get(holder) is conn:
                del self._connections[holder]  # a holder that is gone leaves nothing behind

    async def _exchange(self, conn: _Connection, host: str, port: int, request: bytes) -> tuple[int, bytes]:
        """One request and its answer; once more on a fresh connection if a kept one turns out closed."""
        reused = conn.usable
        if not reused:
            conn.drop()
            await conn.open(host, port)
            self.connects += 1
        try:
            return await conn.ask(request)
        except (ConnectionError, asyncio.IncompleteReadError):
            if not reused:
                raise
        await conn.open(host, port)
        self.connects += 1
        return await conn.ask(request)

    async def close(self) -> None:
        conns = list(self._connections.values())
        self._connections.clear()
        for conn in conns:
            writer = conn.writer
            conn.drop()
            if writer is not None:
                with contextlib.suppress(Exception):
                    await writer.wait_closed()
