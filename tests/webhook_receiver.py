"""A webhook receiver on a real socket (``http.server`` in a thread), for the tests of
video job events (docs/webhooks.md): it records every POST and answers as scripted."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


@dataclass
class Delivery:
    headers: dict[str, str]
    body: bytes
    at: float  # monotonic


@dataclass
class Receiver:
    """A webhook endpoint: answers each POST with the next of ``answers`` (then 200);
    with ``hold`` set, it holds every answer until the event is set (a slow receiver)."""

    answers: list[int] = field(default_factory=list)
    hold: threading.Event | None = None
    got: list[Delivery] = field(default_factory=list)
    url: str = ""


@contextlib.contextmanager
def receiving(receiver: Receiver, host: str = "127.0.0.1") -> Iterator[Receiver]:
    """``receiver`` listening on a free port of ``host`` for the block (pods reach it
    where ``host`` is an address of their network: a test node's bridge gateway)."""

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # http.server names it
            body = self.rfile.read(int(self.headers["content-length"]))
            headers = {k.lower(): v for k, v in self.headers.items()}
            receiver.got.append(Delivery(headers, body, time.monotonic()))
            if receiver.hold is not None:
                receiver.hold.wait(30)
            status = receiver.answers.pop(0) if receiver.answers else 200
            self.send_response(status)
            self.send_header("content-length", "0")
            self.end_headers()

        def log_message(self, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer((host, 0), Handler)
    server.daemon_threads = True
    receiver.url = f"http://{host}:{server.server_address[1]}/hooks/dpserve"
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield receiver
    finally:
        if receiver.hold is not None:
            receiver.hold.set()
        server.shutdown()
        server.server_close()
