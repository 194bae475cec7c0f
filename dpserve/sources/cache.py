"""The model cache: one entry per (source, resolved revision), filled once, published
whole.

Layout under the root (``--model-cache``)::

    entries/<source name>/<revision>/entry.json   the marker: written last, then renamed in
    entries/<source name>/<revision>/model/       an S3 entry's files
    entries/<source name>/<revision>.partial/     a fill under way (resumed after a kill)
    entries/<source name>/<revision>.lock         flock: one filler per entry
    entries/<source name>/<revision>.progress.json
    hf/                                           huggingface_hub's own cache (hub entries
                                                  point into its snapshots)

An entry is ready when its ``entry.json`` exists: the fill writes it into the
``.partial`` folder after every file was verified and renames that folder into
place, so a reader never sees a partial entry. Fillers of one entry on one machine or
one shared volume take its lock in turn: the first fills, the others wait and then
find it ready. The kernel frees the lock of a killed filler, and the next one resumes
from what the ``.partial`` folder holds.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import shutil
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from dpserve.plumbing.durable import fsync_path
from dpserve.sources.errors import SourceError
from dpserve.sources.plan import Plan

log = logging.getLogger("dpserve.sources")
MARKER = "entry.json"


def default_root() -> Path:
    """``$DPSERVE_CACHE/model-cache``, ``~/.cache/dpserve/model-cache`` by default (the
    folder the tiny model and the test binaries are cached under)."""
    return Path(os.environ.get("DPSERVE_CACHE", Path.home() / ".cache" / "dpserve")) / "model-cache"


@dataclass(frozen=True)
class Entry:
    root: Path
    name: str  # the source's folder (one per source, see s3.entry_name / hub.entry_name)
    revision: str

    @property
    def dir(self) -> Path:
        return self.root / "entries" / self.name / self.revision

    @property
    def staging(self) -> Path:
        return self.dir.with_name(self.revision + ".partial")

    @property
    def lock(self) -> Path:
        return self.dir.with_name(self.revision + ".lock")

    @property
    def progress(self) -> Path:
        return self.dir.with_name(self.revision + ".progress.json")


# A fill: given the plan and the staging folder, fetch and verify every file, and
# return the pipeline folder (relative: inside the entry; absolute: under the root).
Filler = Callable[[Plan, Path], Path]


class ModelCache:
    def __init__(self, root: Path) -> None:
        self.root = root.expanduser().absolute()

    def entry(self, name: str, plan: Plan) -> Entry:
        return Entry(self.root, name, plan.revision)

    def ready(self, entry: Entry) -> Path | None:
        """The entry's pipeline folder when it is published, else None."""
        try:
            data = json.loads((entry.dir / MARKER).read_text())
        except FileNotFoundError:
            return None
        except ValueError as exc:
            raise SourceError(
                f"{entry.dir / MARKER} is not JSON ({exc}): remove {entry.dir}"
            ) from None
        return self.root / str(data["folder"])

    def fill(self, entry: Entry, plan: Plan, filler: Filler) -> Path:
        """The entry's folder, filled by ``filler`` unless it is ready (one filler at a
        time per entry; the others wait for it)."""
        folder = self.ready(entry)
        if folder is not None:
            return folder
        with self._locked(entry):
            folder = self.ready(entry)
            if folder is not None:
                log.info("%s is in the cache: another fetch filled it", plan.source)
                return folder
            entry.staging.mkdir(parents=True, exist_ok=True)
            made = filler(plan, entry.staging)
            folder = made if made.is_absolute() else entry.dir / made
            record = {
                **plan.to_json(),
                "folder": str(folder.relative_to(self.root)),
                "fetched_at": time.time(),
            }
            _write(entry.staging / MARKER, json.dumps(record, indent=1) + "\n")
            if entry.dir.exists():  # no marker (checked under the lock): a leftover
                shutil.rmtree(entry.dir)
            entry.staging.rename(entry.dir)
            fsync_path(entry.dir.parent)
            return folder

    @contextlib.contextmanager
    def _locked(self, entry: Entry) -> Iterator[None]:
        entry.lock.parent.mkdir(parents=True, exist_ok=True)
        with entry.lock.open("a+") as f:
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                f.seek(0)
                holder = f.read().strip() or "?"
                log.info("another fetch (pid %s) is filling %s: waiting for it", holder, entry.dir)
                fcntl.flock(f, fcntl.LOCK_EX)
            f.seek(0)
            f.truncate()
            f.write(f"{os.getpid()}\n")
            f.flush()
            try:
                yield
            finally:
                fcntl.flock(f, fcntl.LOCK_UN)

    def entries(self, name: str = "*") -> list[tuple[Entry, dict[str, object]]]:
        """A source's published entries (every source's: ``*``) with their records, the
        newest first."""
        found = []
        for marker in self.root.glob(f"entries/{name}/*/{MARKER}"):
            try:
                record = json.loads(marker.read_text())
            except (OSError, ValueError):
                continue
            found.append((Entry(self.root, marker.parent.parent.name, marker.parent.name), record))
        return sorted(found, key=lambda e: float(e[1].get("fetched_at", 0)), reverse=True)

    def prune(self, name: str, keep: int, protect: frozenset[str] = frozenset()) -> list[Entry]:
        """Remove a source's entries but those whose revision is in ``protect`` (in use)
        and the ``keep`` newest others, never one being filled under its lock. Returns
        what was removed (a hub entry's snapshot is the caller's: see hub.forget)."""
        others = [e for e, _ in self.entries(name) if e.revision not in protect]
        return [e for e in others[keep:] if self._remove(e)]

    def prune_all(
        self, keep: int, protect: frozenset[Path] = frozenset()
    ) -> list[tuple[Entry, dict[str, object]]]:
        """Every source's entries but the ``protect``ed pipeline folders (those loaded)
        and the ``keep`` newest others (to roll back to); entries under a lock (being
        filled) are kept too. Returns the removed entries with their records."""
        wanted = {p.absolute() for p in protect}
        others = [
            (e, r) for e, r in self.entries() if (self.root / str(r.get("folder"))) not in wanted
        ]
        return [(e, r) for e, r in others[keep:] if self._remove(e)]

    def _remove(self, entry: Entry) -> bool:
        with entry.lock.open("a+") as f:
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                return False
            gone = entry.dir.with_name(entry.revision + ".removing")
            entry.dir.rename(gone)  # unpublished first: no reader finds half an entry
            shutil.rmtree(gone)
            shutil.rmtree(entry.staging, ignore_errors=True)
            entry.progress.unlink(missing_ok=True)
            # The lock file stays: unlinked, a waiter on it and a newcomer on a new
            # file would both take "the" lock and fill at once.
            return True


def _write(path: Path, text: str) -> None:
    with path.open("w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
