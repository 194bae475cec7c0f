"""How the router is served: uvicorn, with a guard on its connections.

uvicorn alone waits forever for a request head (its keep-alive timer runs only after
an answer, and any byte stops it), and its ``limit_concurrency`` counts idle sockets
against every caller, the probes' included: 21 silent sockets locked a router with
``--max-connections 20`` for minutes. So the router runs uvicorn's httptools protocol
(what uvicorn's "auto" picks with uvicorn[standard]) with a few hooks:

- a request head must be complete within ``--header-timeout`` of the connection
  opening or of its previous answer, else the connection closes (with a 408 if part
  of a head had come);
- the slots are kept in a ``SlotBook`` (dpserve/router/slots.py): a newcomer past
  ``--max-connections`` or ``--max-connections-per-peer`` displaces the oldest idle
  connection, and a request past a cap with nothing idle to displace is refused in
  the error shape, the probes' (``/livez``, ``/ready``) never;
- the WebSocket protocol gives its slot back when the socket closes.

The hooks are uvicorn's protocol callbacks (``connection_made``, ``on_message_begin``,
``on_headers_complete``, ``on_response_complete``, ``handle_websocket_upgrade``,
``connection_lost``); tests/unit/test_router_slots.py drives them over real sockets.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any, cast

import httptools
import uvicorn
from uvicorn.protocols.http.httptools_impl import STATUS_LINE, HttpToolsProtocol
from uvicorn.protocols.websockets.websockets_sansio_impl import WebSocketsSansIOProtocol

from dpserve.router.openai_api import error_body
from dpserve.router.request_ids import new_id
from dpserve.router.slots import Over, SlotBook, SlotLimits, peer_of


class GuardedConfig(uvicorn.Config):
    """uvicorn's config plus the one server's slot book and head deadline, which its
    protocols read (uvicorn hands every protocol its config)."""

    def __init__(self, app: Any, *, slots: SlotLimits, header_timeout_s: float, **kw: Any) -> None:
        super().__init__(app, http=GuardedHttp, ws=GuardedWebSockets, **kw)
        self.book: SlotBook[asyncio.BaseTransport] = SlotBook(slots)
        self.header_timeout_s = header_timeout_s


class GuardedHttp(HttpToolsProtocol):
    def __init__(self, config: uvicorn.Config, *args: Any, **kw: Any) -> None:
        super().__init__(config, *args, **kw)
        guarded = cast(GuardedConfig, config)
        self.book = guarded.book
        self.header_timeout_s = guarded.header_timeout_s
        self.head_timer: asyncio.TimerHandle | None = None
        self.in_head = False  # part of a head has come
        self.over: Over | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)  # type: ignore[arg-type]
        peer = peer_of(self.client[0] if self.client else None)
        for victim in self.book.opened(transport, peer):
            victim.close()
        self._await_head()

    def connection_lost(self, exc: Exception | None) -> None:
        self._stop_head_timer()
        self.book.closed(self.transport)
        super().connection_lost(exc)

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self.in_head = True

    def on_headers_complete(self) -> None:
        self._stop_head_timer()
        self.in_head = False
        shed, self.over = self.book.busy(self.transport, _path(self.url))
        for victim in shed:
            victim.close()
        if self.over is None:
            super().on_headers_complete()
            return
        # Refused through uvicorn's own request cycle (it reads or drops the body and
        # closes after the answer); a WebSocket's upgrade is refused below.
        served, self.app = self.app, _refusal_app(self.over)
        try:
            super().on_headers_complete()
        finally:
            self.app = served

    def handle_websocket_upgrade(self) -> None:
        if self.over is None:
            super().handle_websocket_upgrade()  # the WebSocket protocol holds the slot now
            return
        _write_error(self.transport, self.over.status, self.over.message)

    def on_response_complete(self) -> None:
        queued = bool(self.pipeline)
        super().on_response_complete()
        if not queued and not self.transport.is_closing():
            self.book.idle(self.transport)
            self._await_head()

    def _await_head(self) -> None:
        self._stop_head_timer()
        self.head_timer = self.loop.call_later(self.header_timeout_s, self._head_late)

    def _stop_head_timer(self) -> None:
        if self.head_timer is not None:
            self.head_timer.cancel()
            self.head_timer = None

    def _head_late(self) -> None:
        self.head_timer = None
        if self.transport.is_closing():
            return
        if not self.in_head:  # nothing asked: closed as an idle keep-alive one is
            self.transport.close()
            return
        _write_error(
            self.transport,
            408,
            f"the request head (request line and headers) did not arrive within "
            f"--header-timeout {self.header_timeout_s:g} s",
        )


class GuardedWebSockets(WebSocketsSansIOProtocol):
    """Gives the connection's slot back when the socket closes."""

    def connection_lost(self, exc: Exception | None) -> None:
        cast(GuardedConfig, self.config).book.closed(self.transport)
        super().connection_lost(exc)


def _path(url: bytes) -> str:
    try:
        return httptools.parse_url(url).path.decode("ascii", "replace")
    except httptools.HttpParserError:
        return ""  # the protocol answers the bad URL itself


def _error_json(status: int, message: str) -> tuple[bytes, str]:
    request_id = new_id()
    return json.dumps(error_body(status, message, None, request_id)).encode(), request_id


def _headers(status: int, body: bytes, request_id: str) -> list[tuple[bytes, bytes]]:
    headers = [
        (b"content-type", b"application/json"),
        (b"content-length", b"%d" % len(body)),
        (b"x-request-id", request_id.encode()),
        (b"connection", b"close"),
    ]
    if status in (429, 503):
        headers.append((b"retry-after", b"1"))
    return headers


def _refusal_app(over: Over) -> Any:
    async def refuse(scope: Any, receive: Any, send: Any) -> None:
        body, request_id = _error_json(over.status, over.message)
        headers = _headers(over.status, body, request_id)
        await send({"type": "http.response.start", "status": over.status, "headers": headers})
        await send({"type": "http.response.body", "body": body})

    return refuse


def _write_error(transport: asyncio.Transport, status: int, message: str) -> None:
    """An answer written straight to the socket (no request cycle runs), then close."""
    body, request_id = _error_json(status, message)
    head = b"".join(b"%s: %s\r\n" % pair for pair in _headers(status, body, request_id))
    transport.write(STATUS_LINE[status] + head + b"\r\n" + body)
    transport.close()
