"""How far a fetch is: pure math over counted bytes, and the sinks that show it.

``Meter`` owns the counters of one fetch (bytes done of the total, bytes moved over
the wire this run, the start) and hands a ``Snapshot`` to its sinks at most every
``every_s`` seconds and once at the end: a periodic log line, a JSON file in the cache
(what a fill Job's watcher, such as the operator, reads), a bar on a terminal.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, Protocol, TextIO

from dpserve.sources.plan import human_bytes

State = Literal["fetching", "ready", "failed"]


@dataclass(frozen=True)
class Snapshot:
    source: str
    revision: str
    state: State
    total: int  # bytes the plan fetches
    done: int  # of them, in place (resumed bytes count: they need no moving)
    moved: int  # bytes moved over the wire by this run
    elapsed_s: float
    error: str = ""

    @property
    def fraction(self) -> float:
        return 1.0 if self.total == 0 else min(1.0, self.done / self.total)

    @property
    def rate(self) -> float:
        """Bytes per second moved by this run (0 until a byte moved)."""
        return self.moved / self.elapsed_s if self.elapsed_s > 0 else 0.0

    @property
    def eta_s(self) -> float | None:
        """Seconds left at the rate so far; None while there is no rate to tell."""
        if self.state != "fetching":
            return 0.0
        return (self.total - self.done) / self.rate if self.rate > 0 else None

    def line(self) -> str:
        eta = self.eta_s
        left = "" if eta is None or self.state != "fetching" else f", {_duration(eta)} left"
        return (
            f"{self.fraction:.0%} ({human_bytes(self.done)} of {human_bytes(self.total)}), "
            f"{human_bytes(int(self.rate))}/s{left}"
        )

    def to_json(self) -> dict[str, object]:
        return {
            "source": self.source,
            "revision": self.revision,
            "state": self.state,
            "bytes_done": self.done,
            "bytes_total": self.total,
            "bytes_moved": self.moved,
            "rate_bytes_per_s": round(self.rate),
            "eta_s": None if self.eta_s is None else round(self.eta_s, 1),
            "elapsed_s": round(self.elapsed_s, 1),
            "error": self.error,
        }


def _duration(s: float) -> str:
    s = int(s)
    return f"{s // 3600}h{s % 3600 // 60:02d}m" if s >= 3600 else f"{s // 60}m{s % 60:02d}s"


class Sink(Protocol):
    def show(self, snap: Snapshot) -> None: ...


class Meter:
    """One fetch's counters; thread-safe (downloads may run on several threads)."""

    def __init__(
        self,
        source: str,
        revision: str,
        total: int,
        sinks: list[Sink],
        every_s: float = 0.5,
    ) -> None:
        self.source, self.revision, self.total = source, revision, total
        self.sinks = sinks
        self.every_s = every_s
        self._lock = threading.Lock()
        self._done = 0
        self._moved = 0
        self._began = time.monotonic()
        self._shown = 0.0

    def add(self, done: int, moved: int = 0) -> None:
        """``done`` more bytes in place, ``moved`` of them over the wire."""
        with self._lock:
            self._done += done
            self._moved += moved
            now = time.monotonic()
            if now - self._shown < self.every_s:
                return
            self._shown = now
        self._show("fetching")

    def finish(self, error: str = "") -> Snapshot:
        return self._show("failed" if error else "ready", error)

    def snapshot(self, state: State = "fetching", error: str = "") -> Snapshot:
        with self._lock:
            done, moved = self._done, self._moved
        elapsed = time.monotonic() - self._began
        return Snapshot(self.source, self.revision, state, self.total, done, moved, elapsed, error)

    def _show(self, state: State, error: str = "") -> Snapshot:
        snap = self.snapshot(state, error)
        for sink in self.sinks:
            sink.show(snap)
        return snap


class LogSink:
    """A log line every ``every_s`` seconds, and one at the end."""

    def __init__(self, log: logging.Logger, every_s: float = 10.0) -> None:
        self.log, self.every_s = log, every_s
        self._last = time.monotonic()

    def show(self, snap: Snapshot) -> None:
        now = time.monotonic()
        if snap.state == "fetching" and now - self._last < self.every_s:
            return
        self._last = now
        if snap.state == "failed":
            self.log.error("fetching %s failed: %s", snap.source, snap.error)
        elif snap.state == "ready":
            self.log.info(
                "fetched %s: %s in %.1fs (%s moved, %s/s)",
                snap.source,
                human_bytes(snap.total),
                snap.elapsed_s,
                human_bytes(snap.moved),
                human_bytes(int(snap.rate)),
            )
        else:
            self.log.info("fetching %s: %s", snap.source, snap.line())


class JsonFileSink:
    """``path`` holds the last snapshot as JSON, replaced whole (a reader never sees
    half a file)."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def show(self, snap: Snapshot) -> None:
        tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}")
        tmp.write_text(json.dumps({**snap.to_json(), "updated": time.time()}) + "\n")
        tmp.replace(self.path)


class JsonLinesSink:
    """One JSON object per line (``"event": "progress"``), at most every ``every_s``
    seconds and at the end: what a watcher of a fill Job's log reads (its last line)."""

    def __init__(self, stream: TextIO, every_s: float = 2.0) -> None:
        self.stream, self.every_s = stream, every_s
        self._last: float | None = None

    def show(self, snap: Snapshot) -> None:
        now = time.monotonic()
        if snap.state == "fetching" and self._last is not None and now - self._last < self.every_s:
            return
        self._last = now
        self.stream.write(json.dumps({"event": "progress", **snap.to_json()}) + "\n")
        self.stream.flush()


class BarSink:
    """A one-line bar redrawn on a terminal (S3 fetches; the hub draws its own)."""

    def __init__(self, stream: TextIO = sys.stderr, width: int = 30) -> None:
        self.stream, self.width = stream, width

    def show(self, snap: Snapshot) -> None:
        filled = int(snap.fraction * self.width)
        bar = "#" * filled + "." * (self.width - filled)
        end = "\n" if snap.state != "fetching" else ""
        self.stream.write(f"\r[{bar}] {snap.line()}\x1b[K{end}")
        self.stream.flush()


def default_sinks(log: logging.Logger, progress_file: Path | None, bar: bool) -> list[Sink]:
    sinks: list[Sink] = [LogSink(log)]
    if progress_file is not None:
        sinks.append(JsonFileSink(progress_file))
    if bar and sys.stderr.isatty():
        sinks.append(BarSink())
    return sinks
