"""A file checked against the source's own digest of it (``plan.Digest``).

A file that does not match is deleted, so it can never be published or loaded, and
the error names it with both digests.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

from dpserve.sources.errors import DigestMismatch, SourceError
from dpserve.sources.plan import Digest, PlannedFile

_CHUNK = 8 << 20


class Hasher:
    """A digest of the kind ``digest`` is, fed as the bytes arrive (a download hashes
    while it writes: no second read)."""

    def __init__(self, digest: Digest, size: int) -> None:
        self.part_size = digest.part_size if digest.algorithm == "md5-parts" else None
        if digest.algorithm == "md5-parts" and not self.part_size:
            raise SourceError("a multipart digest needs its part size")
        name = {"git-sha1": "sha1", "md5-parts": "md5"}.get(digest.algorithm, digest.algorithm)
        self._h = hashlib.new(name)
        if digest.algorithm == "git-sha1":
            self._h.update(f"blob {size}\0".encode())
        self._parts: list[bytes] = []
        self._left = self.part_size or 0

    def update(self, data: bytes) -> None:
        if self.part_size is None:
            self._h.update(data)
            return
        view = memoryview(data)
        while view:
            take = min(self._left, len(view))
            self._h.update(view[:take])
            self._left -= take
            view = view[take:]
            if self._left == 0:  # a part is complete
                self._parts.append(self._h.digest())
                self._h = hashlib.md5()
                self._left = self.part_size

    def hexdigest(self) -> str:
        if self.part_size is None:
            return self._h.hexdigest()
        parts = self._parts + ([self._h.digest()] if self._left != self.part_size else [])
        return f"{hashlib.md5(b''.join(parts)).hexdigest()}-{len(parts)}"

    def feed(self, path: Path) -> Hasher:
        """Every byte of ``path`` (what a resumed download already holds)."""
        with path.open("rb") as f:
            while chunk := f.read(_CHUNK):
                self.update(chunk)
        return self


def compute(path: Path, digest: Digest) -> str:
    """``path``'s digest of the same kind as ``digest`` (the same part size)."""
    return Hasher(digest, path.stat().st_size).feed(path).hexdigest()


def verify(path: Path, planned: PlannedFile, source: str, hashed: str | None = None) -> None:
    """Raise ``DigestMismatch`` (and delete ``path``) unless it is ``planned``'s bytes;
    ``hashed``: its digest, computed while it was written (else it is read now)."""
    size = path.stat().st_size
    got = None
    if size == planned.size:
        got = hashed if hashed is not None else compute(path, planned.digest)
    if got == planned.digest.value:
        return
    path.unlink(missing_ok=True)
    what = (
        f"{size} bytes, not {planned.size}" if got is None else f"{planned.digest.algorithm} {got}"
    )
    raise DigestMismatch(
        f"{planned.path} from {source} is corrupt: the source says "
        f"{planned.digest} ({planned.size} bytes), the bytes fetched are {what}; the file "
        "was deleted and nothing was published: repair or re-upload the object, then fetch again"
    )
