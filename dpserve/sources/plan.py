"""What a fetch will move, known before any byte moves: the resolved revision, each
file with its size and the source's own digest of it, and the total. Pure; it travels
as JSON (``entry.json`` keeps it, and the operator can show it)."""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from dpserve.sources.errors import SourceError

# sha256 / md5: of the whole file (hex). md5-parts: an S3 multipart ETag "hex-N", the
# MD5 of the N parts' MD5s, parts of part_size bytes. git-sha1: the hub's id of a small
# file, sha1 of "blob <size>\0" + the bytes.
Algorithm = Literal["sha256", "md5", "md5-parts", "git-sha1"]
ALGORITHMS: tuple[Algorithm, ...] = ("sha256", "md5", "md5-parts", "git-sha1")


@dataclass(frozen=True)
class Digest:
    algorithm: Algorithm
    value: str
    part_size: int | None = None  # md5-parts only

    def __str__(self) -> str:
        return f"{self.algorithm}:{self.value}"


@dataclass(frozen=True)
class PlannedFile:
    path: str  # relative to the pipeline folder, '/'-separated
    size: int
    digest: Digest


@dataclass(frozen=True)
class Plan:
    source: str  # the canonical URI (no credentials: uri.parse refuses them)
    revision: str  # hub: the commit; s3: a digest of the listing (see listing_revision)
    files: tuple[PlannedFile, ...]

    @property
    def total_bytes(self) -> int:
        return sum(f.size for f in self.files)

    def summary(self) -> str:
        return (
            f"{self.source} at {self.revision}: {len(self.files)} files, "
            f"{human_bytes(self.total_bytes)} ({self.total_bytes} bytes)"
        )

    def to_json(self) -> dict[str, Any]:
        return {
            "source": self.source,
            "revision": self.revision,
            "total_bytes": self.total_bytes,
            "files": [
                {
                    "path": f.path,
                    "size": f.size,
                    "digest": f.digest.algorithm,
                    "value": f.digest.value,
                    **({"part_size": f.digest.part_size} if f.digest.part_size else {}),
                }
                for f in self.files
            ],
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Plan:
        try:
            files = tuple(
                PlannedFile(
                    str(f["path"]),
                    int(f["size"]),
                    Digest(_algorithm(f["digest"]), str(f["value"]), f.get("part_size")),
                )
                for f in data["files"]
            )
            return cls(str(data["source"]), str(data["revision"]), files)
        except (KeyError, TypeError, ValueError) as exc:
            raise SourceError(f"not a fetch plan: {exc}") from None


def _algorithm(name: object) -> Algorithm:
    for known in ALGORITHMS:
        if name == known:
            return known
    raise ValueError(f"unknown digest {name!r}")


def listing_revision(files: Mapping[str, tuple[int, str]]) -> str:
    """A store without commits: the revision is a digest of what the listing says of
    each wanted file (path, size, ETag), so any change makes a new cache entry."""
    h = hashlib.sha256()
    for path in sorted(files):
        size, tag = files[path]
        h.update(f"{path}\0{size}\0{tag}\n".encode())
    return "listing-" + h.hexdigest()[:32]


def human_bytes(n: int) -> str:
    if n < 1000:
        return f"{n} B"
    size = float(n)
    for unit in ("KB", "MB", "GB", "TB"):
        size /= 1000
        if size < 1000 or unit == "TB":
            return f"{size:.1f} {unit}"
    raise AssertionError("unreachable")
