"""The router's connection to one replica's driver: an asyncio DEALER and its reader.

Replies are matched to waiters by request id. The reader task owns the socket's
receive side and hands every failure to the waiters; a ZMQ monitor turns a
dropped TCP connection (the gang died) into an immediate :class:`ReplicaLost`
for everything in flight, instead of a wait for the request timeout.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid
from collections.abc import Callable
from typing import Any

import zmq
import zmq.asyncio
from zmq.utils.monitor import recv_monitor_message

from dpserve.contract import protocol as p
from dpserve.plumbing.curve import WireKey
from dpserve.plumbing.transport import connect_dealer
from dpserve.router.waiting import wait_within

log = logging.getLogger(__name__)


_HANDSHAKE_FAILED = (
    zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
    | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
    | zmq.EVENT_HANDSHAKE_FAILED_AUTH
)
_WATCHED = zmq.EVENT_DISCONNECTED | zmq.EVENT_HANDSHAKE_SUCCEEDED | _HANDSHAKE_FAILED


class ReplicaLost(ConnectionError):
    """The replica went away (or could not be reached) before it replied."""


class ReplicaConnection:
    def __init__(self, ctx: zmq.asyncio.Context, endpoint: str, key: WireKey | None = None) -> None:
        self.endpoint = endpoint
        self._sock = connect_dealer(ctx, endpoint, immediate=True, key=key)
        self._monitor = self._sock.get_monitor_socket(_WATCHED)
        self._refused = False  # the last handshake failed (logged once, until one succeeds)
        self._dropped = False  # between a drop and the next handshake: sends would be lost
        self._pending: dict[str, asyncio.Future[p.Message]] = {}
        # PARTIAL replies go to their request's handler, which must not block (the
        # reader serves every request on this connection).
        self._partials: dict[str, Callable[[p.Message], None]] = {}
        self._tasks = [
            asyncio.create_task(self._read(), name=f"reader {endpoint}"),
            asyncio.create_task(self._watch(), name=f"monitor {endpoint}"),
        ]

    @property
    def in_flight(self) -> int:
        return len(self._pending)

    async def request(
        self,
        kind: str,
        body: Any,
        timeout_s: float,
        blobs: list[bytes] | None = None,
        *,
        request_id: str | None = None,
        deadline_s: float | None = None,
        on_partial: Callable[[p.Message], None] | None = None,
        tenant: str = "",
    ) -> p.Message:
        """Send one request and wait for its reply; an ``error`` reply raises RequestError.
        ``tenant``: whose request it is (the header's).

        ``deadline_s`` is the time the replica is given (sent as the header's
        ``timeout_ms``; a generation past it is dropped there). A generation this
        call stops waiting for (timed out, abandoned, or the caller cancelled) is
        cancelled on the replica, so it does not render for nobody. ``on_partial`` is
        called, from the reader, with each PARTIAL reply before the final one: it must
        return at once (hand the message to a queue).
        """
        request_id = request_id or uuid.uuid4().hex
        timeout_ms = None if deadline_s is None else max(0, int(deadline_s * 1000))
        future: asyncio.Future[p.Message] = asyncio.get_running_loop().create_future()
        self._pending[request_id] = future
        if on_partial is not None:
            self._partials[request_id] = on_partial
        try:
            try:
                if self._dropped:
                    raise zmq.Again
                await self._sock.send_multipart(
                    p.encode(kind, request_id, body, blobs or [], timeout_ms, tenant),
                    flags=zmq.NOBLOCK,
                )
            except zmq.Again:
                raise ReplicaLost(f"{self.endpoint} is not connected") from None
            reply = await wait_within(future, timeout_s)
        except (TimeoutError, asyncio.CancelledError, ReplicaLost):
            # Given up on without a reply (an abandoned replica may yet come back).
            replied = future.done() and not future.cancelled() and future.exception() is None
            if kind == p.GENERATE and not replied:
                self.cancel(request_id)
            raise
        finally:
            self._pending.pop(request_id, None)
            self._partials.pop(request_id, None)
        if reply.kind == p.ERROR:
            raise p.decode_error(reply)
        return reply

    async def cancel_any(
        self, request_id: str, timeout_s: float, scope: str | None = None
    ) -> p.CancelResult:
        """Cancel ``request_id`` whoever sent it (another router, say), if it is
        ``scope``'s; the replica answers where it found it (``p.CANCEL_*``)."""
        asked = p.CancelRequest(request_id=request_id, any_client=True, scope=scope)
        reply = await self.request(p.CANCEL, asked, timeout_s)
        result: p.CancelResult = reply.body_as(p.CancelResult)
        return result

    def cancel(self, request_id: str) -> None:
        """Tell the replica nobody waits for generation ``request_id`` any more.

        Best effort and never answered: if it is still queued or running there, the
        replica answers it ``cancelled`` (at once, or at its next denoising step).
        """
        frames = p.encode(p.CANCEL, uuid.uuid4().hex, p.CancelRequest(request_id=request_id))
        # A non-blocking send completes (or fails) before this returns.
        sent = self._sock.send_multipart(frames, flags=zmq.NOBLOCK)
        sent.add_done_callback(_quietly)

    def abandon(self, reason: str) -> None:
        """Fail everything in flight now (the replica stopped answering pings): callers
        retry elsewhere instead of waiting for the request timeout."""
        if self._pending:
            log.warning("%s: failing %d in flight: %s", self.endpoint, len(self._pending), reason)
        self._fail_all(ReplicaLost(reason))

    def _fail_all(self, exc: Exception) -> None:
        for future in self._pending.values():
            if not future.done():
                future.set_exception(exc)
                future.exception()  # mark retrieved: a waiter that left must not log noise

    async def _read(self) -> None:
        try:
            while True:
                frames = await self._sock.recv_multipart()
                try:
                    message = p.decode(frames)
                except p.ProtocolError as exc:
                    log.warning("dropping an unreadable reply from %s: %s", self.endpoint, exc)
                    continue
                if message.kind == p.PARTIAL:
                    handler = self._partials.get(message.id)
                    if handler is not None:
                        try:
                            handler(message)
                        except Exception:  # one request's handler must not end the reader
                            log.exception("partial handler of %s failed", message.id)
                    continue
                future = self._pending.get(message.id)
                if future is not None and not future.done():
                    future.set_result(message)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # hand the failure to every waiter, then stop
            log.exception("reader of %s failed", self.endpoint)
            self._fail_all(ReplicaLost(f"{self.endpoint}: reader failed: {exc}"))

    async def _watch(self) -> None:
        while True:
            event = await recv_monitor_message(self._monitor)
            if event["event"] == zmq.EVENT_DISCONNECTED:
                self._dropped = True
                if self._pending:
                    n = len(self._pending)
                    log.warning("%s disconnected with %d in flight", self.endpoint, n)
                    self._fail_all(ReplicaLost(f"{self.endpoint} disconnected"))
                await self._redial()
            elif event["event"] == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                self._refused = self._dropped = False
            elif event["event"] & _HANDSHAKE_FAILED and not self._refused:
                # Otherwise the replica just looks down: say why, once per outage.
                self._refused = True
                log.warning(
                    "%s refused the connection's handshake: the router and that replica "
                    "do not share a wire key (--wire-key-file), or only one side has one",
                    self.endpoint,
                )

    async def _redial(self) -> None:
        """Dial again after a drop. libzmq redials by itself after most, but not after
        a protocol error (a reply frame over the cap): it ends that connection for good,
        and a send to its pipe, which lingers a moment, is lost (so none is made)."""
        await asyncio.sleep(0.1)
        with contextlib.suppress(zmq.ZMQError):  # already gone
            self._sock.disconnect(self.endpoint)
        self._sock.connect(self.endpoint)

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._fail_all(ReplicaLost(f"{self.endpoint} closed"))
        self._sock.disable_monitor()
        self._monitor.close(linger=0)
        self._sock.close(linger=0)


def _quietly(sent: asyncio.Future[Any]) -> None:
    """A failed best-effort send (the replica is not connected) needs no one's attention."""
    if not sent.cancelled() and sent.exception() is not None:
        log.debug("cancel not sent: %s", sent.exception())
