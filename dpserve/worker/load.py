"""How busy a gang has been lately: the share of a sliding window it spent working.

Autoscalers read it from the router's metrics (``dpserve_replica_busy_fraction``):
unlike a queue length it says how close to full a replica runs before anything
waits. Written by the gang loop, read by the driver's socket thread (pings): one lock.
"""

from __future__ import annotations

import threading
from collections import deque


class BusyWindow:
    """Busy intervals within the last ``window_s`` seconds (monotonic clock)."""

    def __init__(self, window_s: float = 20.0) -> None:
        self.window_s = window_s
        self._lock = threading.Lock()
        self._done: deque[tuple[float, float]] = deque()  # closed (start, end) intervals
        self._since: float | None = None  # start of the open interval: busy now

    @property
    def busy(self) -> bool:
        return self._since is not None

    def set(self, busy: bool, now: float) -> None:
        with self._lock:
            if busy and self._since is None:
                self._since = now
            elif not busy and self._since is not None:
                self._done.append((self._since, now))
                self._since = None
            self._forget(now)

    def fraction(self, now: float) -> float:
        """Share of ``[now - window_s, now]`` spent busy, 0..1."""
        with self._lock:
            self._forget(now)
            start = now - self.window_s
            spans = [*self._done, *([(self._since, now)] if self._since is not None else [])]
            busy = sum(max(0.0, end - max(begin, start)) for begin, end in spans)
        return min(1.0, busy / self.window_s)

    def _forget(self, now: float) -> None:
        while self._done and self._done[0][1] <= now - self.window_s:
            self._done.popleft()
