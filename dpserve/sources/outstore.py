"""The output store's bucket side, shared by the router (url images, a video's
content) and the worker (a finished video's upload): the client's timeouts, the
store's errors as one ``StoreDown``, and where a video job's objects live.

A video job's objects are ``PREFIX/videos/<job id>/<attempt>.mp4`` and ``.jpg``,
the tenant in their metadata (``x-amz-meta-tenant``). The attempt is in the key
because a re-run holds the same id: the lost owner's stale copy is deleted when it
comes back (router/videos.py), and that must not take the re-run's objects with it.
Whoever reads a job's content takes its newest attempt with both objects there.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, Final

from dpserve.contract.owners import may_see
from dpserve.sources.uri import S3Source

log = logging.getLogger(__name__)

# A store that is down costs seconds, not boto3's minute-long defaults.
CLIENT_TIMEOUTS: Final = {
    "connect_timeout": 3,
    "read_timeout": 20,
    "retries": {"mode": "standard", "max_attempts": 2},
}
UPLOAD_TRIES: Final = 3  # a video's upload, before its job fails
_VARIANTS: Final = {"video": ("mp4", "video/mp4"), "thumbnail": ("jpg", "image/jpeg")}


class StoreDown(Exception):
    """The store refused or did not answer; the message says what to check."""


@contextlib.contextmanager
def store_errors(source: S3Source, what: str = "upload") -> Iterator[None]:
    """boto3's errors as ``StoreDown``, naming the store and what to check (never a
    credential: boto3's messages name none)."""
    from botocore.exceptions import BotoCoreError, ClientError, NoCredentialsError

    where = f"the output store {source}"
    try:
        yield
    except NoCredentialsError:
        raise StoreDown(
            f"{where} has no credentials: set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY "
            "(and AWS_ENDPOINT_URL for a store other than AWS)"
        ) from None
    except ClientError as exc:
        code = exc.response.get("Error", {}).get("Code", "?")
        raise StoreDown(f"{where} refused the {what} ({code})") from None
    except BotoCoreError as exc:
        raise StoreDown(f"{where} did not answer ({exc}); is AWS_ENDPOINT_URL right?") from None


def bucket_client() -> Any:
    from dpserve.sources.s3 import s3_client

    return s3_client(**CLIENT_TIMEOUTS)


@dataclass
class VideoObjects:
    """A bucket prefix's video objects: the worker puts and deletes its jobs', a
    router reads and deletes any job's (blocking calls: run them off an event loop)."""

    source: S3Source
    client: Any = field(default=None, repr=False)  # default: dpserve's S3 client
    sleep: Callable[[float], None] = field(default=time.sleep, repr=False)

    def __post_init__(self) -> None:
        if self.client is None:
            self.client = bucket_client()

    def folder(self, job_id: str) -> str:
        return f"{self.source.prefix}videos/{job_id}/"

    def key(self, job_id: str, attempt: int, variant: str) -> str:
        return f"{self.folder(job_id)}{attempt}.{_VARIANTS[variant][0]}"

    def location(self, job_id: str, attempt: int) -> str:
        """The job record's ``location``: where its two objects are."""
        return f"s3://{self.source.bucket}/{self.folder(job_id)}{attempt}.{{mp4,jpg}}"

    def put(self, job_id: str, attempt: int, tenant: str, video: bytes, thumbnail: bytes) -> str:
        """Upload both objects, tried ``UPLOAD_TRIES`` times a piece; the location.
        ``StoreDown`` (the last failure) when the store does not take them."""
        for variant, data in (("video", video), ("thumbnail", thumbnail)):
            for tried in range(1, UPLOAD_TRIES + 1):
                try:
                    with store_errors(self.source):
                        self.client.put_object(
                            Bucket=self.source.bucket,
                            Key=self.key(job_id, attempt, variant),
                            Body=data,
                            ContentType=_VARIANTS[variant][1],
                            Metadata={"tenant": tenant},
                        )
                    break
                except StoreDown as exc:
                    if tried == UPLOAD_TRIES:
                        raise
                    log.warning("video job %s: upload %d failed: %s", job_id, tried, exc)
                    self.sleep(float(tried))
        return self.location(job_id, attempt)

    def delete(self, job_id: str, attempt: int | None = None) -> None:
        """Remove one attempt's objects, or (None) every attempt's."""
        with store_errors(self.source, "delete"):
            if attempt is None:
                keys = [k for k, _ in self._listed(job_id)]
            else:
                keys = [self.key(job_id, attempt, v) for v in _VARIANTS]
            if keys:
                self.client.delete_objects(
                    Bucket=self.source.bucket,
                    Delete={"Objects": [{"Key": k} for k in keys], "Quiet": True},
                )

    def read(self, job_id: str, variant: str, scope: str | None) -> bytes | None:
        """The newest attempt's object of ``variant``; None when the store holds none
        that ``scope`` may see (another tenant's reads as none, as an unknown id)."""
        attempts = self._attempts(job_id)
        with store_errors(self.source, "read"):
            for attempt in sorted(attempts, reverse=True):
                if len(attempts[attempt]) < len(_VARIANTS):
                    continue  # half uploaded (its job is not completed)
                got = self.client.get_object(
                    Bucket=self.source.bucket, Key=self.key(job_id, attempt, variant)
                )
                if not may_see(scope, got.get("Metadata", {}).get("tenant", "")):
                    got["Body"].close()
                    return None
                data: bytes = got["Body"].read()
                return data
        return None

    def finished(self, job_id: str, attempt: int) -> str | None:
        """The attempt's location when both its objects are in the store (its upload
        finished), else None."""
        done = self._attempts(job_id).get(attempt, set())
        wanted = {ext for ext, _ in _VARIANTS.values()}
        return self.location(job_id, attempt) if wanted <= done else None

    def holds(self, job_id: str, scope: str | None) -> bool:
        """Does the store hold objects of the job that ``scope`` may see?"""
        listed = self._listed(job_id)
        if not listed:
            return False
        with store_errors(self.source, "read"):
            head = self.client.head_object(Bucket=self.source.bucket, Key=listed[0][0])
        return may_see(scope, head.get("Metadata", {}).get("tenant", ""))

    def _listed(self, job_id: str) -> list[tuple[str, str]]:
        """Every object of the job: (key, its name under the job's folder)."""
        folder = self.folder(job_id)
        with store_errors(self.source, "listing"):
            page = self.client.list_objects_v2(Bucket=self.source.bucket, Prefix=folder)
        return [(o["Key"], o["Key"][len(folder) :]) for o in page.get("Contents", [])]

    def _attempts(self, job_id: str) -> dict[int, set[str]]:
        found: dict[int, set[str]] = {}
        for _, name in self._listed(job_id):
            stem, _, ext = name.partition(".")
            if stem.isdigit():
                found.setdefault(int(stem), set()).add(ext)
        return found
