"""Read-ahead of LoRA adapter files (docs/lora.md): the load overlaps the running request.

When the driver admits a request naming an adapter its gang does not hold, a thread
reads the adapter's files while the requests ahead of it run, so the operating
system's page cache holds them by the time the gang loads them: every rank's load
reads memory, not disk. Only the files' bytes are read (nothing is parsed, nothing
changes state), and only folders the gang itself would accept (``AllowedPaths``):
the gang still checks and loads everything itself. Best effort: a folder it cannot
read is left for the gang's load to report.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Final

from dpserve.contract.protocol import AdapterReport, LoraRef, RequestError
from dpserve.worker.paths import AllowedPaths

log = logging.getLogger(__name__)

CHUNK: Final = 8 << 20
# A folder read this recently is in the page cache still (or was evicted under memory
# pressure, which reading it again would not beat): not read again.
FRESH_S: Final = 30.0
PENDING: Final = 64  # folders waiting; more are dropped (it is only a hint)


def missing(refs: Sequence[LoraRef], report: AdapterReport | None) -> list[str]:
    """The paths of ``refs`` that the gang does not hold, as far as the last report says."""
    if report is None:
        return []
    resident = set(report.resident)
    paths = []
    for ref in refs:
        path = ref.path if ref.path is not None else report.known.get(ref.name)
        if ref.name not in resident and path is not None:
            paths.append(path)
    return paths


@dataclass
class ReadAhead:
    allowed: AllowedPaths
    read_bytes: int = 0  # what it read, for the log and the tests
    folders: int = 0
    _todo: queue.Queue[str | None] = field(default_factory=lambda: queue.Queue(PENDING))
    _read_at: dict[str, float] = field(default_factory=dict)
    _thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="lora-read-ahead", daemon=True)
        self._thread.start()

    def want(self, refs: Sequence[LoraRef] | None, report: AdapterReport | None) -> None:
        """Called on the socket thread when a request queues: never blocks."""
        for path in missing(refs or (), report):
            try:
                self._todo.put_nowait(path)
            except queue.Full:
                return

    def close(self) -> None:
        if self._thread is not None:
            self._todo.put(None)
            self._thread.join(timeout=5)

    def _run(self) -> None:
        while (path := self._todo.get()) is not None:
            now = time.monotonic()
            if now - self._read_at.get(path, -FRESH_S) < FRESH_S:
                continue
            self._read_at = {p: t for p, t in self._read_at.items() if now - t < FRESH_S}
            self._read_at[path] = now
            try:
                self.read_bytes += self._read(path)
                self.folders += 1
            except (RequestError, OSError) as exc:
                log.debug("read-ahead of %s skipped: %s", path, exc)

    def _read(self, path: str) -> int:
        folder = self.allowed.folder(path, "lora")
        total = 0
        for file in sorted(folder.iterdir()):
            if file.suffix != ".safetensors" or not file.is_file():
                continue
            with file.open("rb", buffering=0) as f:
                while chunk := f.read(CHUNK):
                    total += len(chunk)
        return total
