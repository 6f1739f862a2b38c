"""The front door's HTTP server, hardened against hostile clients.

aiohttp's connection handler with a header read timeout (aiohttp has none: only an idle keep-alive
timeout; a client trickling its headers, slowloris, would hold a connection for an hour), stated
line limits, and the errors of the HTTP layer itself (a malformed request line or header, a line
too long) answered as JSON in the API's error shape and logged in one line rather than as a
traceback. `python -m services.prefill_queue` serves the app with `Runner`.

It subclasses aiohttp's `RequestHandler` and replaces the protocol factory of the `Server` that
`AppRunner` builds: internals, so an aiohttp upgrade is checked by tests/integration/test_hostile_clients.py.
"""

from __future__ import annotations

import asyncio
import json
from http import HTTPStatus
from typing import Any

from aiohttp import web
from aiohttp.web_protocol import RequestHandler
from aiohttp.web_request import BaseRequest

from shared.runtime.logs import get_logger

#: A request's line and headers must arrive within this time of its first byte (of the connection
#: opening, for a connection's first request), else the connection gets a 408 and is closed: a
#: client trickling headers (slowloris) holds a connection for at most this long.
HEADER_TIMEOUT_S = 10.0
#: An idle keep-alive connection is closed after this long (aiohttp's default is an hour).
KEEPALIVE_TIMEOUT_S = 75.0
#: The longest request line and header line (aiohttp's defaults, stated): longer gets a 400.
MAX_LINE_BYTES = 8190
MAX_FIELD_BYTES = 8190

log = get_logger(__name__)


class HttpProtocol(RequestHandler):
    """aiohttp's HTTP/1.1 connection handler with a header read timeout (aiohttp has none: only an
    idle keep-alive timeout) and errors of the HTTP layer (a malformed request line or header, a line
    too long) answered as JSON in the API's error shape and logged in one line, not as a traceback."""

    __slots__ = ("_armed_at_count", "_header_timeout_s", "_header_timer")

    def __init__(self, manager: web.Server, *, header_timeout_s: float = HEADER_TIMEOUT_S, **kwargs: Any) -> None:
        super().__init__(manager, **kwargs)
        self._header_timeout_s = header_timeout_s
        self._header_timer: asyncio.TimerHandle | None = None
        self._armed_at_count = 0

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        self._arm()  # the first request's headers are due from the connection's opening

    def data_received(self, data: bytes) -> None:
        if self._header_timer is None and self._waiter is not None and not self._waiter.done():
            self._arm()  # idle between requests, and bytes arrive: a request's headers begin
        super().data_received(data)
        if self._request_count != self._armed_at_count:
            self._disarm()  # a whole request line and headers arrived

    def connection_lost(self, exc: BaseException | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def _arm(self) -> None:
        self._disarm()
        self._armed_at_count = self._request_count
        self._header_timer = self._loop.call_later(self._header_timeout_s, self._headers_late)

    def _disarm(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _headers_late(self) -> None:
        self._header_timer = None
        if self._request_count != self._armed_at_count or self._request_in_progress or self.transport is None:
            return
        peer = self.transport.get_extra_info("peername")
        log.info("closing a connection: request headers not received in time", peer=peer, s=self._header_timeout_s)
        message = f"the request line and headers did not arrive within {self._header_timeout_s:g} s"
        body = _error_body(408, message).encode()
        head = f"HTTP/1.1 408 Request Timeout\r\nContent-Type: application/json\r\nContent-Length: {len(body)}\r\n"
        self.transport.write(head.encode() + b"Connection: close\r\n\r\n" + body)
        self.force_close()  # closes the transport once the answer is written

    def handle_error(
        self, request: BaseRequest, status: int = 500, exc: BaseException | None = None, message: str | None = None
    ) -> web.StreamResponse:
        if isinstance(exc, ConnectionResetError):  # a streamed answer's write found the client gone
            log.info("the client closed the connection before its answer was complete", peer=request.remote)
            raise ConnectionError("the client closed the connection") from exc
        if status >= 500:
            self.log_exception("error handling a request", exc_info=exc)  # a server bug: the traceback
            message = "internal error: the request failed on the server"
        else:
            message = message or (str(exc) if exc else HTTPStatus(status).phrase)
            log.info("bad HTTP request", peer=request.remote, status=status, error=message)
        if request.writer.output_size > 0:
            raise ConnectionError("a response was already being sent: the connection is closed")
        resp = web.Response(status=status, text=_error_body(status, message), content_type="application/json")
        resp.force_close()
        return resp


class _Server(web.Server):
    def __call__(self) -> RequestHandler:
        return HttpProtocol(self, loop=self._loop, **self._kwargs)


class Runner(web.AppRunner):
    """`web.AppRunner` whose connections are `HttpProtocol`s, with this module's limits and timeouts.
    Keyword arguments (``header_timeout_s``, ``keepalive_timeout``, aiohttp's) override them."""

    def __init__(self, app: web.Application, **kwargs: Any) -> None:
        kwargs.setdefault("header_timeout_s", HEADER_TIMEOUT_S)
        kwargs.setdefault("keepalive_timeout", KEEPALIVE_TIMEOUT_S)
        kwargs.setdefault("max_line_size", MAX_LINE_BYTES)
        kwargs.setdefault("max_field_size", MAX_FIELD_BYTES)
        super().__init__(app, **kwargs)

    async def _make_server(self) -> web.Server:
        server = await super()._make_server()
        server.__class__ = _Server  # aiohttp builds the Server; only its protocol factory changes
        return server


def _error_body(status: int, message: str) -> str:
    type_ = "server_error" if status >= 500 else "invalid_request_error"
    return json.dumps({"error": {"message": message, "type": type_, "param": None, "code": status}})
