"""KV caches on the data plane: a finished prefill's KV cache stays in the memory of the worker that
computed it, and a decode service fetches it from there over TCP; Redis carries only the handle
(`PrefillResult.kv_holder`, `kv_key`) (`prefill.kv_store: plane`, the default; `redis` keeps the
old store, `shared.dataplane.kvstore`).

The holder (a stage worker) keeps each cache as its safetensors bytes (`shared.dataplane.kvstore.kv_file`) on
a `KvShelf`: `prefill.kv_ttl_s` after the answer it expires (a sweep drops expired caches every
`SWEEP_S`), and the caches held at once stay within `prefill.kv_budget_mb` of the worker's memory
(past it a prefill answers without one, and the handle says why). Its `KvServer` listens on the
worker's data-plane host, on a port of its own (ephemeral unless given); the address, "host:port",
is the holder's name: `PrefillResult.kv_holder`, the handle's "holder". A decode service asks with
a `KvClient`, which keeps one connection per holder (requests to one holder take turns on it).

The protocol, "bubbletea-kv-wire/1" (a consumer outside this repository, e.g. a vLLM KV connector,
speaks it with the standard library alone, so it is fixed as written here):

* Connection: TCP to "host:port". Persistent: requests are served one after another on a
  connection for as long as the client keeps it open; either side may close it at any time; a
  client reconnects on its next request, and retries a request once if the connection it reused
  turns out closed (both operations are idempotent).
* Request: ``struct.pack("!4sBH", b"BTKV", op, len(id_bytes)) + id_bytes``, the id the request id
  in UTF-8 (at most `MAX_ID_BYTES`). op 1 FETCH: send the KV cache of id; op 2 FREE: the cache of
  id is used, drop it.
* Response: ``struct.pack("!4sBQ", b"BTKV", status, length)`` + `length` bytes. Status 0 OK: FETCH
  -> the safetensors bytes, FREE -> length 0. Status 1 NOT_HELD: a UTF-8 sentence (expired, freed
  or never held here; a FREE of a cache not held answers it too). Status 2 BAD_REQUEST: a UTF-8
  sentence (bad magic, unknown op, id longer than 1024 bytes or not UTF-8), and the server then
  closes the connection.

Why a plain socket and not a gloo group, as the training tensors use: a group formed per fetch (as
this module first did) cost a rendezvous through Redis and a new connection per fetch, 14-20 ms
for 0.5 MiB (`bench/transport_kv.py`); a gloo group kept per holder and fetcher cannot survive
either end's death (gloo has no reconnection: a broken group is useless, and re-forming it is the
same rendezvous again) and would need our Redis store on the consumer's side. A socket per pair is
kept across fetches, reconnects by itself, fails at once when its holder is gone (connection
refused, or the kept connection closed), and a vLLM worker can speak it with the standard library.

The server runs on the worker's event loop, which also drives training: it only looks the id up
and writes, with `drain` (a client that stops reading is dropped after `WRITE_TIMEOUT_S`); a client
that disconnects mid-request costs it that connection alone. Idle connections are closed after
`IDLE_S` (the client reconnects on its next request), and TCP keepalive finds a peer whose host
vanished. A holder that is gone took its caches with it: a fetch fails at once saying so.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import struct
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from shared.runtime.logs import get_logger

if TYPE_CHECKING:
    from shared.dataplane.kvstore import Stored

log = get_logger(__name__)

PROTOCOL = "bubbletea-kv-wire/1"
MAGIC = b"BTKV"
#: A request's head: magic, op, the id's length in bytes (the id follows).
REQUEST = struct.Struct("!4sBH")
#: A response's head: magic, status, the body's length in bytes (the body follows).
RESPONSE = struct.Struct("!4sBQ")
OP_FETCH, OP_FREE = 1, 2
OK, NOT_HELD, BAD_REQUEST = 0, 1, 2
#: The longest request id a server takes (longer: BAD_REQUEST).
MAX_ID_BYTES = 1024

#: How long a fetch or free waits, in all, for its answer (connecting and waiting its turn included).
KV_FETCH_TIMEOUT_S = 10.0
#: How often a holder drops its expired caches.
SWEEP_S = 5.0
#: A connection that brings no request for this long is closed by the server.
IDLE_S = 300.0
#: A client that takes longer than this to read an answer is disconnected.
WRITE_TIMEOUT_S = 30.0
#: The client's stream buffer: an answer up to twice this is read without pausing the socket.
READ_LIMIT = 4 << 20


@dataclass
class _Held:
    data: bytes  # the safetensors bytes
    expires: float  # wall clock


@dataclass
class KvShelf:
    """The KV caches one worker holds (pure: the caller passes `now`)."""

    ttl_s: int
    budget_bytes: int
    held: dict[str, _Held] = field(default_factory=dict)
    used: int = 0

    def put(self, request_id: str, data: bytes, now: float) -> Stored:
        """Hold `data` for `ttl_s` unless it would take the caches held past `budget_bytes`
        (then `key` is "", as `shared.dataplane.kvstore.store_kv_within_budget` says it)."""
        from shared.dataplane.kvstore import (
            Stored,  # torch (safetensors): only a holder puts; a client stays torch-free
        )

        self.expire(now)
        self.delete(request_id)  # a request answered twice (redelivered) holds one cache
        if self.used + len(data) > self.budget_bytes:
            return Stored("", len(data), self.used, self.budget_bytes)
        self.held[request_id] = _Held(bytes(data), now + self.ttl_s)
        self.used += len(data)
        return Stored(request_id, len(data), self.used, self.budget_bytes)

    def get(self, request_id: str, now: float) -> bytes | None:
        held = self.held.get(request_id)
        if held is None or held.expires <= now:
            return None
        return held.data

    def delete(self, request_id: str) -> bool:
        held = self.held.pop(request_id, None)
        if held is not None:
            self.used -= len(held.data)
        return held is not None

    def expire(self, now: float) -> int:
        gone = [rid for rid, h in self.held.items() if h.expires <= now]
        for rid in gone:
            self.delete(rid)
        return len(gone)


def holder_address(host: str, port: int) -> str:
    """The holder's name: "host:port" (an IPv6 host in brackets)."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def parse_holder(holder: str) -> tuple[str, int]:
    """(host, port) of a holder's "host:port"; ValueError if it is not one."""
    host, sep, port = holder.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"{holder!r} is not a KV holder's address (host:port)")
    return host.removeprefix("[").removesuffix("]"), int(port)


def tcp_keepalive(writer: asyncio.StreamWriter) -> None:
    sock = writer.get_extra_info("socket")
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)


class _BadRequest(Exception):
    """A request the server refuses (BAD_REQUEST), and then closes the connection."""


class KvServer:
    """A worker's KV caches, served to decode services over TCP (module docstring)."""

    def __init__(
        self,
        shelf: KvShelf,
        host: str,
        port: int = 0,
        *,
        idle_s: float = IDLE_S,
        write_timeout_s: float = WRITE_TIMEOUT_S,
        sweep_s: float = SWEEP_S,
    ) -> None:
        self.shelf, self.host, self.port = shelf, host, port
        self.idle_s, self.write_timeout_s, self.sweep_s = idle_s, write_timeout_s, sweep_s
        #: "host:port" once started: `PrefillResult.kv_holder`.
        self.holder = ""
        self.accepted = 0  # connections accepted
        self.served = 0  # caches sent (FETCH answered OK)
        self.freed = 0  # caches dropped by a FREE
        self.refused = 0  # BAD_REQUESTs answered
        self._server: asyncio.Server | None = None
        self._sweeper: asyncio.Task[None] | None = None
        #: The connections being served, with their writers (closed to end them at shutdown).
        self._handlers: dict[asyncio.Task[None], asyncio.StreamWriter] = {}

    @property
    def held(self) -> int:
        """How many KV caches this worker holds now."""
        return len(self.shelf.held)

    @property
    def connections(self) -> int:
        """How many client connections are open now."""
        return len(self._handlers)

    async def start(self) -> str:
        """Listen; the holder's address, "host:port" (also `self.holder`)."""
        self._server = await asyncio.start_server(self._connection, self.host, self.port, reuse_address=True)
        self.port = self._server.sockets[0].getsockname()[1]
        self.holder = holder_address(self.host, self.port)
        self._sweeper = asyncio.create_task(self._sweep(), name="kv-sweep")
        log.info("KV caches held on the data plane", holder=self.holder, protocol=PROTOCOL)
        return self.holder

    async def _connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._handlers[task] = writer
        self.accepted += 1
        tcp_keepalive(writer)
        peer = writer.get_extra_info("peername")
        try:
            while True:
                try:
                    async with asyncio.timeout(self.idle_s):
                        op, rid = await self._request(reader)
                except (asyncio.IncompleteReadError, TimeoutError):
                    return  # the client closed the connection (possibly mid-request), or left it idle
                status, body = self._answer(op, rid)
                await self._send(writer, status, body)
        except _BadRequest as exc:
            self.refused += 1
            log.warning("KV request refused", peer=peer, error=str(exc))
            with contextlib.suppress(ConnectionError, TimeoutError):
                await self._send(writer, BAD_REQUEST, str(exc).encode())
        except (ConnectionError, TimeoutError) as exc:  # it went away, or stopped reading its answer
            log.debug("KV client dropped", peer=peer, error=repr(exc))
        finally:
            self._handlers.pop(task, None)
            writer.close()
            with contextlib.suppress(Exception):
                await writer.wait_closed()

    @staticmethod
    async def _request(reader: asyncio.StreamReader) -> tuple[int, str]:
        magic, op, n = REQUEST.unpack(await reader.readexactly(REQUEST.size))
        if magic != MAGIC:
            raise _BadRequest(f"not a {PROTOCOL} request: it starts with {magic!r}, not {MAGIC!r}")
        if op not in (OP_FETCH, OP_FREE):
            raise _BadRequest(f"unknown op {op}: {OP_FETCH} is FETCH, {OP_FREE} is FREE")
        if n > MAX_ID_BYTES:
            raise _BadRequest(f"a request id of {n} bytes: at most {MAX_ID_BYTES}")
        raw = await reader.readexactly(n)
        try:
            return op, raw.decode()
        except UnicodeDecodeError:
            raise _BadRequest("the request id is not UTF-8") from None

    def _answer(self, op: int, rid: str) -> tuple[int, bytes]:
        now = time.time()
        if op == OP_FREE:
            if self.shelf.delete(rid):
                self.freed += 1
                return OK, b""
            return NOT_HELD, f"no KV cache of {rid} is held here: already freed, expired or never held".encode()
        data = self.shelf.get(rid, now)
        if data is not None:
            self.served += 1
            return OK, data
        if rid in self.shelf.held:
            why = f"the KV cache of {rid} expired (prefill.kv_ttl_s: {self.shelf.ttl_s} s after its answer)"
        else:
            why = f"no KV cache of {rid} is held here: it was freed, it expired (prefill.kv_ttl_s) or it never was"
        return NOT_HELD, why.encode()

    async def _send(self, writer: asyncio.StreamWriter, status: int, body: bytes) -> None:
        writer.write(RESPONSE.pack(MAGIC, status, len(body)))
        if body:
            writer.write(body)
        async with asyncio.timeout(self.write_timeout_s):
            await writer.drain()

    async def _sweep(self) -> None:
        while True:
            self.shelf.expire(time.time())
            await asyncio.sleep(self.sweep_s)

    async def close(self) -> None:
        """Stop listening and close every connection (the caches go with this worker)."""
        if self._sweeper is not None:
            self._sweeper.cancel()
            await asyncio.gather(self._sweeper, return_exceptions=True)
        if self._server is not None:
            self._server.close()
        # Closing a connection ends its handler at its next read, normally: a cancelled handler
        # would have asyncio log its CancelledError as an error in the stream's callback.
        handlers = dict(self._handlers)
        for writer in handlers.values():
            writer.close()
        _, late = await asyncio.wait(handlers, timeout=2.0) if handlers else (set(), set())
        for t in late:  # one stuck in a write: cut it off
            t.cancel()
        await asyncio.gather(*late, return_exceptions=True)
        if self._server is not None:
            await self._server.wait_closed()
