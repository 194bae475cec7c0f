"""Video job records in the output store: what lets a job outlive every pod that
touched it (docs/outputs.md, "Jobs that outlive their pods").

A record is ``PREFIX/videos/<id>/job.json`` beside the job's outputs (one folder:
deleting the job deletes it all), holding what a router needs to answer for the job
and to run it again: its parameters and input images (``input-<i>``), tenant, the
replica holding it, its last status, and a **lease**: the router that watches it and
until when. Two small index objects make the sweeps cheap listings, not a read of
every record: ``PREFIX/jobs/active/<id>`` while the job still needs a watcher (not
finished, or its event not delivered), ``PREFIX/jobs/expires/<unix s>.<id>`` once it
finished with an expiry.

Every write of a record after the first is conditional on the ETag it was read with
(S3's ``If-Match``): of two routers racing to take a lease, or a router whose lease
was taken over while it stalled, exactly one write lands and the other learns it
lost. ETags are the MD5 of the bytes, so each write bumps ``version``: no two writes
of one record have the same bytes.

These calls block (boto3): run them off an event loop.
"""

from __future__ import annotations

import logging
from typing import Any, Final, NamedTuple

import msgspec

from dpserve.contract import protocol as p
from dpserve.contract import video
from dpserve.sources.outstore import VideoObjects, store_errors

log = logging.getLogger(__name__)

RECORD: Final = "job.json"
_LOST: Final = frozenset({"PreconditionFailed", "NoSuchKey", "404", "412"})


class JobRecord(msgspec.Struct, kw_only=True):
    """One job as the store keeps it."""

    job: video.VideoJob  # its last status as the watching router saw it
    params: p.GenerateParams  # seeds fixed: a re-run makes the same frames
    inputs: int = 0  # input images stored beside it (``input-<i>``)
    holder: str = ""  # the replica's endpoint holding it; "" while none does
    boot: str = ""  # that replica's boot id when it took the job
    router: str = ""  # the router holding the lease
    lease_until: float = 0.0  # unix seconds
    announced: bool = False  # its terminal event was delivered, given up, or has none
    version: int = 0  # bumped on every write (ETags are MD5s of the bytes)

    @property
    def settled(self) -> bool:
        """Finished and told: nothing left for a watcher to do."""
        return self.job.status in video.TERMINAL and self.announced


class Stored(NamedTuple):
    """A record and the ETag it was read or written with (the next write's condition)."""

    record: JobRecord
    etag: str


class JobRecords:
    """The records of one output store prefix (shares its client with the outputs)."""

    def __init__(self, objects: VideoObjects) -> None:
        self.objects = objects
        self.source = objects.source
        self._client: Any = objects.client

    def _key(self, job_id: str, name: str = RECORD) -> str:
        return f"{self.objects.folder(job_id)}{name}"

    def _active(self, job_id: str = "") -> str:
        return f"{self.source.prefix}jobs/active/{job_id}"

    def _expiry(self, at: int = -1, job_id: str = "") -> str:
        stamp = "" if at < 0 else f"{at:011d}.{job_id}"
        return f"{self.source.prefix}jobs/expires/{stamp}"

    def create(self, record: JobRecord, blobs: list[bytes]) -> Stored:
        """A new job's record, its inputs first (a record never names a missing one)."""
        job_id = record.job.id
        meta = {"tenant": record.job.tenant}
        with store_errors(self.source, "job record"):
            for i, blob in enumerate(blobs):
                self._put(self._key(job_id, f"input-{i}"), blob, meta)
            record = msgspec.structs.replace(record, inputs=len(blobs), version=1)
            etag = self._put(self._key(job_id), msgspec.json.encode(record), meta, IfNoneMatch="*")
            self._put(self._active(job_id), b"", {})
        return Stored(record, etag)

    def read(self, job_id: str) -> Stored | None:
        """The job's record; None when the store has none (never made, or deleted)."""
        with store_errors(self.source, "job record read"):
            try:
                got = self._client.get_object(Bucket=self.source.bucket, Key=self._key(job_id))
            except self._client.exceptions.NoSuchKey:
                return None
            data: bytes = got["Body"].read()
        try:
            return Stored(msgspec.json.decode(data, type=JobRecord), got["ETag"])
        except msgspec.ValidationError as exc:  # a record this version cannot read
            log.error("video job %s: its record is unreadable: %s", job_id, exc)
            return None

    def replace(self, stored: Stored, record: JobRecord) -> Stored | None:
        """Write ``record`` over ``stored`` if nobody wrote it since; None when somebody
        did (another router holds the lease now) or it is gone (deleted)."""
        from botocore.exceptions import ClientError

        record = msgspec.structs.replace(record, version=stored.record.version + 1)
        meta = {"tenant": record.job.tenant}
        key = self._key(record.job.id)
        with store_errors(self.source, "job record"):
            try:
                etag = self._put(key, msgspec.json.encode(record), meta, IfMatch=stored.etag)
            except ClientError as exc:
                if exc.response.get("Error", {}).get("Code") in _LOST:
                    return None
                raise
        return Stored(record, etag)

    def inputs(self, record: JobRecord) -> list[bytes]:
        """The job's input images, in order."""
        blobs = []
        with store_errors(self.source, "job input read"):
            for i in range(record.inputs):
                key = self._key(record.job.id, f"input-{i}")
                blobs.append(
                    self._client.get_object(Bucket=self.source.bucket, Key=key)["Body"].read()
                )
        return blobs

    def active(self) -> list[str]:
        """Ids of the jobs that still need a watcher."""
        return [key.rsplit("/", 1)[-1] for key in self._keys(self._active())]

    def settle(self, record: JobRecord) -> None:
        """A finished, told job leaves the active index, joining the expiry one."""
        with store_errors(self.source, "job index"):
            if record.job.expires_at is not None:
                self._put(self._expiry(record.job.expires_at, record.job.id), b"", {})
            self._delete([self._active(record.job.id)])

    def unindex(self, job_id: str) -> None:
        """Drop an active index entry whose record is gone (the job was deleted)."""
        with store_errors(self.source, "job index"):
            self._delete([self._active(job_id)])

    def expired(self, now: float) -> list[str]:
        """Ids of the jobs whose expiry has come (their index entries are removed)."""
        due = [k for k in self._keys(self._expiry()) if int(k.rsplit("/", 1)[-1][:11]) <= now]
        with store_errors(self.source, "job index"):
            self._delete(due)
        return [key.rsplit("/", 1)[-1][12:] for key in due]

    def remove(self, job_id: str, expires_at: int | None) -> None:
        """Every object of the job, its record and index entries included."""
        self.objects.delete(job_id)
        index = [self._active(job_id)]
        if expires_at is not None:
            index.append(self._expiry(expires_at, job_id))
        with store_errors(self.source, "job index"):
            self._delete(index)

    # ------------------------------------------------------------ plumbing

    def _put(self, key: str, body: bytes, meta: dict[str, str], **condition: str) -> str:
        answer = self._client.put_object(
            Bucket=self.source.bucket, Key=key, Body=body, Metadata=meta, **condition
        )
        etag: str = answer["ETag"]
        return etag

    def _delete(self, keys: list[str]) -> None:
        if keys:
            self._client.delete_objects(
                Bucket=self.source.bucket,
                Delete={"Objects": [{"Key": k} for k in keys], "Quiet": True},
            )

    def _keys(self, prefix: str) -> list[str]:
        keys: list[str] = []
        with store_errors(self.source, "job index listing"):
            pages = self._client.get_paginator("list_objects_v2")
            for page in pages.paginate(Bucket=self.source.bucket, Prefix=prefix):
                keys.extend(o["Key"] for o in page.get("Contents", []))
        return keys
