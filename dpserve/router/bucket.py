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

import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

from dpserve.sources.outstore import StoreDown, bucket_client, store_errors
from dpserve.sources.uri import BadUri, LocalSource, S3Source, parse

__all__ = ["BucketStore", "StoreDown", "parse_output_store"]

# SigV4's bound on a presigned link's life (seven days).
MAX_URL_TTL_S: Final = 7 * 24 * 3600
_TYPES: Final = {"png": "image/png", "jpeg": "image/jpeg", "webp": "image/webp"}
FORMS: Final = "s3://BUCKET/PREFIX, file:///PATH or a folder"


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
            self.client = bucket_client()

    def key(self, name: str) -> str:
        return f"{self.source.prefix}images/{name}"

    def save(self, data: bytes, fmt: str, tenant: str = "") -> str:
        """Upload an image of ``tenant``'s; a presigned link to it (blocking: call it
        off the event loop). ``StoreDown`` when the store does not take it."""
        name = f"{uuid.uuid4().hex}.{tenant}.{fmt}" if tenant else f"{uuid.uuid4().hex}.{fmt}"
        key = self.key(name)
        with store_errors(self.source):
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
