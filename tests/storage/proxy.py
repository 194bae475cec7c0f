"""A TCP forwarder in front of a server that counts the bytes the server sends, and can
slow them down: an independent witness of how many bytes a client really fetched (a
resumed fetch moves only the rest; two concurrent fetches move one model).

It forwards bytes unchanged, so a SigV4 signature made for the forwarder's address
still holds (the server checks the Host header the client signed).
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from types import TracebackType


class CountingProxy:
    def __init__(
        self, target: str, rate_bytes_per_s: float | None = None, listen_host: str = "127.0.0.1"
    ) -> None:
        """``listen_host``: where clients reach it (a test node's bridge gateway for pods)."""
        host, port = target.removeprefix("http://").rsplit(":", 1)
        self.target = (host, int(port))
        self.rate = rate_bytes_per_s  # None: as fast as it comes; may change while running
        self._lock = threading.Lock()
        self._sent = 0
        self._listener = socket.create_server((listen_host, 0))
        self.url = f"http://{listen_host}:{self._listener.getsockname()[1]}"
        self._closed = threading.Event()
        self._conns: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    @property
    def sent(self) -> int:
        """Bytes the server sent to clients through this forwarder so far."""
        with self._lock:
            return self._sent

    def _accept(self) -> None:
        while not self._closed.is_set():
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            server = socket.create_connection(self.target)
            self._conns += [client, server]
            threading.Thread(target=self._pump, args=(client, server, False), daemon=True).start()
            threading.Thread(target=self._pump, args=(server, client, True), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket, counted: bool) -> None:
        try:
            while chunk := src.recv(64 * 1024):
                if counted:
                    with self._lock:
                        self._sent += len(chunk)
                    if self.rate:
                        time.sleep(len(chunk) / self.rate)  # the throttle itself
                dst.sendall(chunk)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                with contextlib.suppress(OSError):
                    s.shutdown(socket.SHUT_RDWR)

    def close(self) -> None:
        self._closed.set()
        self._listener.close()
        for s in self._conns:
            s.close()

    def __enter__(self) -> CountingProxy:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()
