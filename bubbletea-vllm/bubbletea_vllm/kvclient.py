"""A blocking client of a BubbleTea KV holder ("bubbletea-kv-wire/1"), standard library only.

The stage worker that prefilled a prompt keeps its KV cache in memory and serves it on a TCP port;
the handle's ``holder`` is that ``host:port``. The protocol, as the holder speaks it
(`shared/dataplane/kv.py` in BubbleTea, docs/api.md "The KV cache"):

    request:  "!4sBH" (b"BTKV", op, len(id)) + id (UTF-8)      op 1 FETCH, op 2 FREE
    response: "!4sBQ" (b"BTKV", status, length) + length bytes
              status 0 OK (FETCH: the safetensors bytes), 1 NOT_HELD (a sentence why),
              2 BAD_REQUEST (a sentence; the holder closes the connection)

One connection per holder is kept and reused, so a fetch costs one round trip, not a connect; a
connection found closed when reused (the holder restarted, or dropped an idle one) is reopened and
the request sent once more. A holder that is gone fails the request at once (connection refused)
or after `timeout_s`, with a sentence that names it.
"""

from __future__ import annotations

import socket
import struct
import threading

MAGIC = b"BTKV"
REQUEST = struct.Struct("!4sBH")
RESPONSE = struct.Struct("!4sBQ")
FETCH, FREE = 1, 2
OK, NOT_HELD, BAD_REQUEST = 0, 1, 2

#: How long one request may take, connect included (a 0.5 MiB cache takes about a millisecond).
DEFAULT_TIMEOUT_S = 10.0


class KvUnavailable(Exception):
    """The KV cache cannot be had: not held (expired or freed), or its holder is gone. The message
    is a sentence for the person reading vLLM's log."""


def parse_address(holder: str) -> tuple[str, int]:
    host, sep, port = holder.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise KvUnavailable(f"the KV holder address {holder!r} is not host:port")
    return host.strip("[]"), int(port)


class KvClient:
    """Fetches and frees KV caches, keeping one connection per holder (thread-safe)."""

    def __init__(self, timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
        self.timeout_s = timeout_s
        self._conns: dict[str, socket.socket] = {}
        self._locks: dict[str, threading.Lock] = {}
        self._guard = threading.Lock()
        #: Connections opened, for tests and logs (one per holder while the holder lives).
        self.connects = 0

    def fetch(self, holder: str, request_id: str) -> bytes:
        """The safetensors bytes of `request_id`'s KV cache, or `KvUnavailable` saying why not."""
        return self._request(holder, FETCH, request_id)

    def free(self, holder: str, request_id: str) -> bool:
        """Tell the holder the cache is used. False if it was not held (already freed, expired)."""
        try:
            self._request(holder, FREE, request_id)
        except KvUnavailable:
            return False
        return True

    def close(self) -> None:
        with self._guard:
            conns, self._conns = list(self._conns.values()), {}
        for s in conns:
            s.close()

    def _lock(self, holder: str) -> threading.Lock:
        with self._guard:
            return self._locks.setdefault(holder, threading.Lock())

    def _request(self, holder: str, op: int, request_id: str) -> bytes:
        key = request_id.encode()
        if len(key) > 0xFFFF:
            raise KvUnavailable("a KV cache id is at most 65535 bytes")
        frame = REQUEST.pack(MAGIC, op, len(key)) + key
        with self._lock(holder):
            reused = holder in self._conns
            try:
                return self._exchange(holder, frame, request_id)
            except (ConnectionError, _Closed) as exc:
                self._drop(holder)
                if not reused:
                    raise self._gone(holder, request_id, exc) from None
            except OSError as exc:  # refused, unreachable, timed out
                self._drop(holder)
                raise self._gone(holder, request_id, exc) from None
            try:  # the kept connection had died under us: once more on a fresh one
                return self._exchange(holder, frame, request_id)
            except (OSError, _Closed) as exc:
                self._drop(holder)
                raise self._gone(holder, request_id, exc) from None

    def _exchange(self, holder: str, frame: bytes, request_id: str) -> bytes:
        s = self._conns.get(holder)
        if s is None:
            s = socket.create_connection(parse_address(holder), timeout=self.timeout_s)
            s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self._conns[holder] = s
            self.connects += 1
        s.settimeout(self.timeout_s)
        s.sendall(frame)
        magic, status, length = RESPONSE.unpack(_read(s, RESPONSE.size))
        if magic != MAGIC:
            raise _Closed("the holder answered with something that is not bubbletea-kv-wire/1")
        body = _read(s, length)
        if status == OK:
            return body
        reason = body.decode(errors="replace")
        if status == BAD_REQUEST:
            self._drop(holder)
            raise KvUnavailable(f"the KV holder {holder} refused the request for {request_id}: {reason}")
        raise KvUnavailable(reason or f"no KV cache for {request_id} on {holder}")

    def _drop(self, holder: str) -> None:
        s = self._conns.pop(holder, None)
        if s is not None:
            s.close()

    @staticmethod
    def _gone(holder: str, request_id: str, exc: BaseException) -> KvUnavailable:
        why = str(exc) or type(exc).__name__
        return KvUnavailable(f"the worker holding the KV cache of {request_id} ({holder}) is gone: {why}")


class _Closed(Exception):
    """The connection ended before a whole answer came."""


def _read(s: socket.socket, n: int) -> bytes:
    buf = bytearray(n)
    view, got = memoryview(buf), 0
    while got < n:
        k = s.recv_into(view[got:])
        if k == 0:
            raise _Closed("the holder closed the connection mid-answer")
        got += k
    return bytes(buf)
