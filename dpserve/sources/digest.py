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


def compute(path: Path, digest: Digest) -> str:
    """``path``'s digest of the same kind as ``digest`` (the same part size)."""
    if digest.algorithm == "md5-parts":
        return _md5_parts(path, digest)
    h = hashlib.new("sha1" if digest.algorithm == "git-sha1" else digest.algorithm)
    if digest.algorithm == "git-sha1":
        h.update(f"blob {path.stat().st_size}\0".encode())
    with path.open("rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def _md5_parts(path: Path, digest: Digest) -> str:
    if not digest.part_size:
        raise SourceError(f"{path.name}: a multipart digest needs its part size")
    parts = []
    with path.open("rb") as f:
        while True:
            part = hashlib.md5()
            left = digest.part_size
            while left and (chunk := f.read(min(left, _CHUNK))):
                part.update(chunk)
                left -= len(chunk)
            if left == digest.part_size:
                break  # nothing read: the end
            parts.append(part.digest())
    return f"{hashlib.md5(b''.join(parts)).hexdigest()}-{len(parts)}"


def verify(path: Path, planned: PlannedFile, source: str) -> None:
    """Raise ``DigestMismatch`` (and delete ``path``) unless it is ``planned``'s bytes."""
    size = path.stat().st_size
    got = compute(path, planned.digest) if size == planned.size else None
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
