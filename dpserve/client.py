"""A blocking client of one replica's driver, for tools, tests and benchmarks."""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from types import TracebackType
from typing import Any

import zmq

from dpserve.contract import protocol as p
from dpserve.contract import realtime as rt
from dpserve.plumbing.curve import WireKey
from dpserve.plumbing.transport import connect_dealer


class ReplicaTimeout(TimeoutError):
    pass


class ReplicaClient:
    def __init__(self, endpoint: str, timeout_s: float = 60.0, key: WireKey | None = None) -> None:
        """``key``: the service's wire key, for a driver that has one (a driver with a
        key answers nothing without it; a driver without one, nothing with it)."""
        self.endpoint = endpoint
        self.timeout_s = timeout_s
        self._ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        self._sock = connect_dealer(self._ctx, endpoint, key=key)

    def __enter__(self) -> ReplicaClient:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def close(self) -> None:
        self._sock.close(linger=0)
        self._ctx.term()

    def send_raw(self, frames: list[bytes]) -> None:
        self._sock.send_multipart(frames)

    def recv(self, timeout_s: float | None = None) -> p.Message:
        wait = self.timeout_s if timeout_s is None else timeout_s
        if not self._sock.poll(int(wait * 1000)):
            raise ReplicaTimeout(f"no reply from {self.endpoint} within {wait:.1f}s")
        return p.decode(self._sock.recv_multipart())

    def call(
        self,
        kind: str,
        body: Any = None,
        timeout_s: float | None = None,
        blobs: Sequence[bytes] = (),
    ) -> p.Message:
        """One request and its reply; an error reply raises :class:`protocol.RequestError`."""
        request_id = uuid.uuid4().hex
        self.send_raw(p.encode(kind, request_id, body, blobs))
        while True:
            reply = self.recv(timeout_s)
            if reply.id == request_id:  # skip late replies to requests that timed out
                break
        if reply.kind == p.ERROR:
            raise p.decode_error(reply)
        return reply

    def ping(self, timeout_s: float | None = None) -> p.PingResult:
        result: p.PingResult = self.call(p.PING, timeout_s=timeout_s).body_as(p.PingResult)
        return result

    def generate(self, **fields: Any) -> tuple[p.GenerateResult, list[bytes]]:
        reply = self.call(p.GENERATE, fields)
        result: p.GenerateResult = reply.body_as(p.GenerateResult)
        return result, [reply.blobs[meta.blob] for meta in result.images]

    def session(
        self, request: rt.SessionRequest, blobs: Sequence[bytes] = ()
    ) -> tuple[Any, list[bytes]]:
        """A session action: a :class:`realtime.FrameResult` and its frame for open and
        step, a :class:`realtime.SessionInfo` (and no blobs) for resume and close."""
        reply = self.call(p.SESSION, request, blobs=blobs)
        if request.action in (rt.OPEN, rt.STEP):
            frame: rt.FrameResult = reply.body_as(rt.FrameResult)
            return frame, [reply.blobs[frame.blob]]
        return reply.body_as(rt.SessionInfo), []

    def control(self, op: str, **args: Any) -> dict[str, Any]:
        reply = self.call(p.CONTROL, p.ControlRequest(op=op, args=args))
        result: p.ControlResult = reply.body_as(p.ControlResult)
        return result.result
