"""The driver's socket thread: the one thread that owns the ROUTER socket.

It receives, decodes each message's envelope and hands the message to admission
(worker/driver/admission.py), whose immediate answer it sends back. Answers from
other threads (the gang loop's) reach it over an inproc socket, because a ZMQ
socket must only be used by the thread that owns it. Malformed frames are answered
with an error when they carry a request id, else dropped and logged; nothing a peer
sends can stop this thread.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

import zmq

from dpserve.contract import protocol as p
from dpserve.plumbing.curve import Gatekeeper, WireKey, plaintext_warning
from dpserve.plumbing.transport import bind_router, bound_endpoint, inproc_pair

log = logging.getLogger(__name__)

# A decoded request from a peer: its immediate answer, or None (queued, or none due).
Handler = Callable[[bytes, p.Message], list[bytes] | None]
Turn = Callable[[float], None]  # called once per poll turn with the monotonic time


class SocketThread:
    def __init__(
        self, endpoint: str, replica: int, *, settle: bool = False, key: WireKey | None = None
    ) -> None:
        """Bind on the caller's thread, so a taken port fails the start-up loudly (or,
        asked to ``settle``, moves to a free one: :attr:`endpoint` is what was bound).
        ``key``: the service's wire key; the socket is then a CURVE server that admits
        only clients holding it. None: a plaintext wire (warned loudly)."""
        self._stop = threading.Event()
        self._ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        self._replies_in, self._replies_out = inproc_pair(self._ctx, f"replies-{id(self)}")
        # The gatekeeper answers handshakes from before the first peer can connect.
        self.gate = Gatekeeper(self._ctx, key) if key is not None else None
        try:
            self._sock = bind_router(self._ctx, endpoint, settle=settle, key=key)
        except zmq.ZMQError:
            if self.gate is not None:
                self.gate.close()
            raise
        self.endpoint = bound_endpoint(self._sock)
        if key is None:
            plaintext_warning(
                f"replica {replica}'s driver on {self.endpoint}",
                "anyone who can reach its port can run generations and control ops",
            )
        self._thread = threading.Thread(target=self._run, name="dpserve-driver-socket", daemon=True)
        self._handle: Handler = lambda identity, message: None
        self._turn: Turn = lambda now: None

    def start(self, handle: Handler, turn: Turn) -> None:
        self._handle, self._turn = handle, turn
        self._thread.start()

    def send(self, identity: bytes, frames: list[bytes]) -> None:
        """Send to a peer: at once on this thread, else through the inproc pair."""
        if threading.current_thread() is self._thread:
            self._sock.send_multipart([identity, *frames])
        else:
            self._replies_out.send_multipart([identity, *frames])

    def close(self) -> None:
        """Stop the thread once the answers handed to it have gone out."""
        self._stop.set()
        self._thread.join(timeout=5)
        for sock in (self._replies_out, self._replies_in, self._sock):
            sock.close()
        if self.gate is not None:
            self.gate.close()
        self._ctx.term()

    # ------------------------------------------------------------ the thread

    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        poller.register(self._replies_in, zmq.POLLIN)
        # Drain replies even after stop was asked, so in-flight answers go out.
        while not self._stop.is_set() or self._replies_in.poll(0):
            events = dict(poller.poll(100))
            if self._replies_in in events:
                self._sock.send_multipart(self._replies_in.recv_multipart())
            if self._sock in events:
                frames = self._sock.recv_multipart()
                try:
                    self._receive(frames)
                except Exception:  # never let one message end the thread
                    log.exception("dropping a message that could not be handled")
            self._turn(time.monotonic())

    def _receive(self, frames: list[bytes]) -> None:
        if len(frames) < 2:
            log.warning("dropping a message without identity or header (%d frames)", len(frames))
            return
        identity, rest = frames[0], frames[1:]
        try:
            message = p.decode(rest)
        except p.ProtocolError as exc:
            if exc.request_id is None:
                log.warning("dropping a malformed message: %s", exc)
                return
            self.send(identity, p.encode_error(exc.request_id, _invalid(exc)))
            return
        try:
            reply = self._handle(identity, message)
        except p.ProtocolError as exc:
            reply = p.encode_error(message.id, _invalid(exc))
        except p.RequestError as exc:
            reply = p.encode_error(message.id, exc)
        if reply is not None:
            self.send(identity, reply)


def _invalid(exc: p.ProtocolError) -> p.RequestError:
    return p.RequestError(p.INVALID_REQUEST, str(exc))
