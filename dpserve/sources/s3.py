"""``s3://BUCKET/PREFIX``: any S3-compatible store, through boto3 and its usual
configuration (``AWS_ENDPOINT_URL``, ``AWS_ACCESS_KEY_ID``, ``AWS_SECRET_ACCESS_KEY``,
``AWS_REGION``, profiles): dpserve has no credential flags of its own.

Digests, the store's own, strongest first: a stored full-object
``x-amz-checksum-sha256``; else the ETag, which is the MD5 of a single-part
upload, and for a multipart upload (``"<hex>-<N>"``) the MD5 of its parts' MD5s, the
part size read from ``head_object(PartNumber=1)``. (An object encrypted with SSE-KMS
or SSE-C has an ETag that is no MD5: upload those with ``ChecksumAlgorithm='SHA256'``.)

A file downloads to ``<path>.part`` and resumes from its length with
``Range: bytes=N-``, is verified, then renamed (a mismatch deletes it).
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import logging
import re
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from dpserve.sources import select
from dpserve.sources.cache import Entry
from dpserve.sources.digest import Hasher, verify
from dpserve.sources.errors import SourceError
from dpserve.sources.plan import Digest, Plan, PlannedFile, listing_revision
from dpserve.sources.progress import Meter
from dpserve.sources.uri import S3Source

log = logging.getLogger("dpserve.sources")
_CHUNK = 1 << 20
_MULTIPART = re.compile(r"^[0-9a-f]{32}-(\d+)$")
_MD5 = re.compile(r"^[0-9a-f]{32}$")
FOLDER = "model"  # the pipeline folder inside an entry


def s3_client(**config: Any) -> Any:
    """A boto3 S3 client configured by the environment (``AWS_*``, profiles), as every
    part of dpserve that talks to a bucket makes it; ``config``: more botocore
    ``Config`` options (timeouts, say)."""
    import boto3
    from botocore.config import Config

    # Checksums only when an operation needs them: a ranged GET of an object with a
    # stored checksum has none to validate. SigV4 throughout: a presigned link boto3
    # signs with SigV2 unless told otherwise, which current stores refuse.
    options: dict[str, Any] = {
        "response_checksum_validation": "when_required",
        "retries": {"mode": "standard"},
        "signature_version": "s3v4",
        **config,
    }
    # A session of its own: boto3's default one is process-wide and keeps the
    # credentials it first resolved.
    return boto3.session.Session().client("s3", config=Config(**options))


def entry_name(source: S3Source) -> str:
    """The cache folder of a bucket prefix: readable, and unique by a hash of it."""
    slug = re.sub(r"[^A-Za-z0-9._-]+", "-", f"{source.bucket}--{source.prefix}").strip("-.")
    return f"s3--{slug[:80]}--{hashlib.sha256(str(source).encode()).hexdigest()[:12]}"


class S3Store:
    """Plans and fills from one bucket prefix; ``client``: a boto3 S3 client (default:
    boto3's, configured by the environment)."""

    def __init__(self, source: S3Source, client: Any = None, threads: int = 8) -> None:
        self.source = source
        self.name = entry_name(source)
        self.draws_own_bars = False
        self._client = client
        self.threads = threads

    @property
    def client(self) -> Any:
        if self._client is None:
            self._client = s3_client()
        return self._client

    def plan(self) -> Plan:
        with _store_errors(self.source, "list"):
            listed = self._list()
            if select.INDEX not in listed:
                raise select.NotAPipeline(
                    f"{self.source} holds no {select.INDEX}: a model source must be a "
                    "diffusers pipeline folder (what save_pretrained writes), uploaded "
                    "under that prefix"
                )
            body = self.client.get_object(Bucket=self.source.bucket, Key=self._key(select.INDEX))
            index = select.read_index(body["Body"].read())
            chosen = select.select(listed, index)
            files = tuple(self._planned(path, listed[path]) for path in chosen.files)
        tags = {path: (listed[path]["Size"], listed[path]["ETag"]) for path in chosen.files}
        return Plan(str(self.source), listing_revision(tags), files)

    def _key(self, path: str) -> str:
        return self.source.prefix + path

    def _list(self) -> dict[str, dict[str, Any]]:
        out = {}
        pages = self.client.get_paginator("list_objects_v2")
        for page in pages.paginate(Bucket=self.source.bucket, Prefix=self.source.prefix):
            for obj in page.get("Contents", []):
                path = obj["Key"][len(self.source.prefix) :]
                if path and not path.endswith("/"):
                    out[path] = obj
        return out

    def _planned(self, path: str, obj: dict[str, Any]) -> PlannedFile:
        size, etag = int(obj["Size"]), str(obj["ETag"]).strip('"').lower()
        if "SHA256" in obj.get("ChecksumAlgorithm", ()):
            head = self.client.head_object(
                Bucket=self.source.bucket, Key=self._key(path), ChecksumMode="ENABLED"
            )
            stored = head.get("ChecksumSHA256") or ""
            if stored and "-" not in stored and head.get("ChecksumType") != "COMPOSITE":
                return PlannedFile(path, size, Digest("sha256", base64.b64decode(stored).hex()))
        if _MD5.match(etag):
            return PlannedFile(path, size, Digest("md5", etag))
        multipart = _MULTIPART.match(etag)
        if multipart:
            first = self.client.head_object(
                Bucket=self.source.bucket, Key=self._key(path), PartNumber=1
            )
            return PlannedFile(path, size, Digest("md5-parts", etag, int(first["ContentLength"])))
        raise SourceError(
            f"{self.source}{path}: the store gives no digest dpserve can check (ETag "
            f"{etag!r}, no SHA-256 checksum): upload it with ChecksumAlgorithm='SHA256'"
        )

    def folder(self, root: Path, revision: str) -> Path:
        """Where a fill of ``revision`` publishes the pipeline, under the cache ``root``."""
        return Entry(root, self.name, revision).dir / FOLDER

    def fill(self, plan: Plan, staging: Path, meter: Meter) -> Path:
        """Every planned file under ``staging/model``, verified; returns ``model``."""
        folder = staging / FOLDER
        with ThreadPoolExecutor(self.threads, thread_name_prefix="s3-fetch") as pool:
            done = [pool.submit(self._file, f, folder / f.path, meter) for f in plan.files]
            for future in done:
                future.result()  # the first failure, after the others stopped or finished
        return Path(FOLDER)

    def _file(self, planned: PlannedFile, final: Path, meter: Meter) -> None:
        if final.is_file() and final.stat().st_size == planned.size:
            meter.add(planned.size)  # verified before it was renamed in
            return
        final.parent.mkdir(parents=True, exist_ok=True)
        part = final.with_name(final.name + ".part")
        offset = part.stat().st_size if part.exists() else 0
        if offset > planned.size:
            part.unlink()
            offset = 0
        meter.add(offset)
        hasher = Hasher(planned.digest, planned.size)
        part.touch()
        hasher.feed(part)  # what a killed fetch left: hashed, not fetched again
        if offset < planned.size:
            with _store_errors(self.source, planned.path), part.open("ab") as out:
                for chunk in self._read(planned.path, offset):
                    out.write(chunk)
                    hasher.update(chunk)
                    meter.add(len(chunk), len(chunk))
        verify(part, planned, str(self.source), hasher.hexdigest())
        part.rename(final)

    def _read(self, path: str, offset: int) -> Iterator[bytes]:
        kw: dict[str, Any] = {"Bucket": self.source.bucket, "Key": self._key(path)}
        if offset:
            kw["Range"] = f"bytes={offset}-"
        body = self.client.get_object(**kw)["Body"]
        try:
            yield from body.iter_chunks(_CHUNK)
        finally:
            body.close()


@contextlib.contextmanager
def _store_errors(source: S3Source, what: str) -> Iterator[None]:
    """boto3's errors as ``SourceError``s naming the object and what to check (never a
    credential: boto3's messages name none)."""
    from botocore.exceptions import BotoCoreError, ClientError, NoCredentialsError

    where = f"{source}" if what == "list" else f"{source}{what}"
    try:
        yield
    except NoCredentialsError:
        raise SourceError(
            f"{where}: no S3 credentials: set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY "
            "(or AWS_PROFILE), and AWS_ENDPOINT_URL for a store other than AWS"
        ) from None
    except ClientError as exc:
        code = exc.response.get("Error", {}).get("Code", "?")
        hint = {
            "NoSuchBucket": "the bucket does not exist",
            "NoSuchKey": "the object is gone (listed, then deleted?): fetch again",
            "AccessDenied": "the credentials may not read it",
            "InvalidAccessKeyId": "check AWS_ACCESS_KEY_ID",
            "SignatureDoesNotMatch": "check AWS_SECRET_ACCESS_KEY",
        }.get(code, "see the store's error code")
        raise SourceError(f"{where}: the store answered {code}: {hint}") from None
    except BotoCoreError as exc:
        raise SourceError(f"{where}: {exc} (is AWS_ENDPOINT_URL the store's address?)") from None
