"""Where ``response_format=url`` images go when the output store is a bucket.

``--output-store s3://BUCKET/PREFIX``: each image is uploaded to
``PREFIX/images/<uuid>.<tenant>.<format>`` (the tenant also in the object's
metadata) and answered as a presigned GET link good for ``--output-url-ttl``
seconds. The link goes to the store, not to a router: any router pod answers for
any image, and an image outlives the router that made it. The router never lists
nor deletes the bucket; a lifecycle rule on the prefix bounds it (docs/outputs.md).

The client is dpserve's one S3 client (dpserve/sources/s3.py), configured the
ecosystem's way: ``AWS_ENDPOINT_URL``, ``AWS_ACCESS_KEY_ID``,
``AWS_SECRET_ACCESS_KEY``, ``AWS_REGION``, profiles. A store that does not answer
fails the upload within a few seconds (``StoreDown``), never hangs the request.
"""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

from dpserve.sources.uri import BadUri, LocalSource, S3Source, parse

# SigV4's bound on a presigned link's life (seven days).
MAX_URL_TTL_S: Final = 7 * 24 * 3600
# A store that is down costs the request seconds, not boto3's minute-long defaults.
_CLIENT_TIMEOUTS: Final = {
    "connect_timeout": 3,
    "read_timeout": 20,
    "retries": {"mode": "standard", "max_attempts": 2},
}
_TYPES: Final = {"png": "image/png", "jpeg": "image/jpeg", "webp": "image/webp"}
FORMS: Final = "s3://BUCKET/PREFIX, file:///PATH or a folder"


class StoreDown(Exception):
    """The store refused or did not answer an upload; the message says what to check."""


def parse_output_store(text: str) -> S3Source | Path:
    """``--output-store``'s value: a bucket prefix, or a local folder (``file:///PATH``
    or a bare path, the same as ``--output-dir PATH``). ValueError says what to fix."""
    if text.startswith("file://"):
        path = text.removeprefix("file://")
        if not path.startswith("/"):
            raise ValueError(f"{text}: a file URI is file:///ABSOLUTE/PATH")
        return Path(path)
    try:
        found = parse(text)
    except BadUri as exc:
        raise ValueError(f"{exc} (an output store is {FORMS})") from None
    if isinstance(found, S3Source):
        return found
    if isinstance(found, LocalSource):
        return found.path
    raise ValueError(f"{text}: an output store is {FORMS}, not a model hub")


@dataclass
class BucketStore:
    """Uploads images under ``source``'s prefix and presigns links to them."""

    source: S3Source
    url_ttl_s: int
    client: Any = field(default=None, repr=False)  # default: dpserve's S3 client

    def __post_init__(self) -> None:
        if self.client is None:
            from dpserve.sources.s3 import s3_client

            self.client = s3_client(**_CLIENT_TIMEOUTS)

    def key(self, name: str) -> str:
        return f"{self.source.prefix}images/{name}"

    def save(self, data: bytes, fmt: str, tenant: str = "") -> str:
        """Upload an image of ``tenant``'s; a presigned link to it (blocking: call it
        off the event loop). ``StoreDown`` when the store does not take it."""
        name = f"{uuid.uuid4().hex}.{tenant}.{fmt}" if tenant else f"{uuid.uuid4().hex}.{fmt}"
        key = self.key(name)
        with _store_errors(self.source):
            self.client.put_object(
                Bucket=self.source.bucket,
                Key=key,
                Body=data,
                ContentType=_TYPES.get(fmt, "application/octet-stream"),
                Metadata={"tenant": tenant},
            )
        url: str = self.client.generate_presigned_url(
            "get_object",
            Params={"Bucket": self.source.bucket, "Key": key},
            ExpiresIn=self.url_ttl_s,
        )
        return url


@contextlib.contextmanager
def _store_errors(source: S3Source) -> Iterator[None]:
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
        raise StoreDown(f"{where} refused the upload ({code})") from None
    except BotoCoreError as exc:
        raise StoreDown(f"{where} did not answer ({exc}); is AWS_ENDPOINT_URL right?") from None
