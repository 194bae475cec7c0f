"""One answer of the output rank to one request, as values.

A generation's answer (its result, a preview or a video's progress, or why it
stopped) leaves the executor as a :class:`Reply`; the driver's output path
(worker/driver/outbox.py) encodes it for the client that asked, or hands it as it
is to the video job book. Nothing is encoded to be decoded again in one process.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from dpserve.contract import protocol as p


@dataclass(frozen=True)
class Reply:
    kind: str  # protocol.RESULT, PARTIAL or ERROR
    request_id: str
    body: Any  # the kind's body struct; for ERROR the RequestError itself
    blobs: tuple[bytes, ...] = ()

    @classmethod
    def error(cls, request_id: str, error: p.RequestError) -> Reply:
        return cls(p.ERROR, request_id, error)

    def frames(self) -> list[bytes]:
        """The wire message a client gets."""
        if self.kind == p.ERROR:
            return p.encode_error(self.request_id, self.body)
        return p.encode(self.kind, self.request_id, self.body, self.blobs)
