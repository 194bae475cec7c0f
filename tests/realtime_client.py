"""A realtime WebSocket client for tests and benchmarks (the `websockets` library, sync)."""

from __future__ import annotations

from types import TracebackType
from typing import Any

import msgspec
from websockets.exceptions import ConnectionClosed
from websockets.sync.client import connect

PATH = "/v1/realtime_video/generate"


class RealtimeSocket:
    def __init__(self, router_url: str, timeout_s: float = 60.0) -> None:
        self.timeout_s = timeout_s
        # The client is a context manager in websockets >= 16; this object is ours.
        url = router_url.replace("http", "ws", 1) + PATH
        self._connection = connect(url, max_size=None, compression=None)
        self.ws = self._connection.__enter__()
        self.session_id: str | None = None

    def send(self, **message: Any) -> None:
        self.ws.send(msgspec.msgpack.encode(message))

    def send_raw(self, data: bytes | str) -> None:
        self.ws.send(data)

    def recv(self, timeout_s: float | None = None) -> dict[str, Any]:
        raw = self.ws.recv(timeout=timeout_s or self.timeout_s)
        assert isinstance(raw, bytes), f"a text message came back: {raw!r}"
        message = msgspec.msgpack.decode(raw)
        assert isinstance(message, dict)
        return message

    def expect(self, kind: str, timeout_s: float | None = None) -> dict[str, Any]:
        message = self.recv(timeout_s)
        assert message["type"] == kind, f"expected {kind}, got {message}"
        return message

    def init(self, **fields: Any) -> tuple[dict[str, Any], dict[str, Any]]:
        """Open a session: its init_ack and its first frame."""
        self.send(type="init", **fields)
        ack = self.expect("init_ack")
        self.session_id = ack["session_id"]
        return ack, self.expect("frame")

    def resume(self, session_id: str, **fields: Any) -> dict[str, Any]:
        self.send(type="resume", session_id=session_id, **fields)
        ack = self.expect("init_ack")
        self.session_id = ack["session_id"]
        return ack

    def step(self, prompt: str | None = None) -> dict[str, Any]:
        if prompt is not None:
            self.send(type="prompt", action_content=prompt)
        self.send(type="step")
        return self.expect("frame")

    def frames(self, n: int) -> list[dict[str, Any]]:
        return [self.expect("frame") for _ in range(n)]

    def closed_code(self, timeout_s: float = 30.0) -> int | None:
        """Read until the server closes the socket; its close code."""
        try:
            while True:
                self.ws.recv(timeout=timeout_s)
        except ConnectionClosed as exc:
            return exc.rcvd.code if exc.rcvd is not None else None

    def close(self) -> None:
        self._connection.__exit__(None, None, None)

    def __enter__(self) -> RealtimeSocket:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()
