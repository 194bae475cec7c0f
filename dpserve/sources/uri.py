"""What ``--model`` names: a hub repository, a bucket prefix, or a local folder.

``hf://ORG/NAME[@REVISION]`` and ``s3://BUCKET[/PREFIX]`` are fetched into the model
cache; anything without a ``scheme://`` is a local folder, used as it is (as before
sources existed). Any other scheme is refused rather than taken for a folder name.
Credentials never belong in a URI (they would reach logs and process lists): the
store's own variables carry them (``AWS_*``, ``HF_TOKEN``). Pure.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Final

from dpserve.sources.errors import SourceError

FORMS: Final = "hf://ORG/NAME[@REVISION], s3://BUCKET/PREFIX or a local folder"
# The hub's repository names: letters, digits, '-', '_', '.'; no '--' or '..'; <= 96.
_REPO_PART = re.compile(r"^[A-Za-z0-9](?:[A-Za-z0-9._-]*[A-Za-z0-9_])?$")
# S3 bucket names (the strict, DNS-compatible rules every store accepts).
_BUCKET = re.compile(r"^[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]$")
_SCHEME = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://")


class BadUri(SourceError):
    pass


@dataclass(frozen=True)
class HubSource:
    repo_id: str  # ORG/NAME
    revision: str = "main"  # a branch, tag or commit; resolved to a commit before fetching

    def __str__(self) -> str:
        return f"hf://{self.repo_id}@{self.revision}"


@dataclass(frozen=True)
class S3Source:
    bucket: str
    prefix: str  # "" (the whole bucket) or a folder ending in "/"

    def __str__(self) -> str:
        return f"s3://{self.bucket}/{self.prefix}"


@dataclass(frozen=True)
class LocalSource:
    path: Path

    def __str__(self) -> str:
        return str(self.path)


Source = HubSource | S3Source | LocalSource


def model_name(source: Source) -> str | None:
    """The name a model is served as by default: the hub's ORG/NAME (as vLLM and SGLang
    name a hub model), a prefix's last folder, or a local folder's name."""
    if isinstance(source, HubSource):
        return source.repo_id
    if isinstance(source, S3Source):
        return source.prefix.rstrip("/").rsplit("/", 1)[-1] or source.bucket
    return source.path.name or source.path.resolve().name or None


def parse(text: str) -> Source:
    """The source ``text`` names; ``BadUri`` says what to fix."""
    scheme = _SCHEME.match(text)
    if scheme is None:
        if not text:
            raise BadUri(f"the model is empty: give {FORMS}")
        return LocalSource(Path(text))
    rest = text[scheme.end() :]
    if "@" in rest.split("/", 1)[0] or ":" in rest.split("/", 1)[0]:
        raise BadUri(
            f"{_redacted(text)}: credentials do not belong in a model URI (logs and process "
            "lists show it); give them to the store's client: AWS_ACCESS_KEY_ID and "
            "AWS_SECRET_ACCESS_KEY for s3://, HF_TOKEN or `hf auth login` for hf://"
        )
    kind = scheme.group(1).lower()
    if kind == "hf":
        return _hub(text, rest)
    if kind == "s3":
        return _s3(text, rest)
    raise BadUri(f"{text}: unknown scheme {kind!r}; give {FORMS}")


def _hub(text: str, rest: str) -> HubSource:
    repo, at, revision = rest.partition("@")
    parts = repo.split("/")
    if len(parts) != 2 or not all(_REPO_PART.match(p) for p in parts):
        raise BadUri(
            f"{text}: a hub model is hf://ORG/NAME[@REVISION], e.g. "
            "hf://black-forest-labs/FLUX.1-dev@main (names: letters, digits, '-', '_', '.')"
        )
    if len(repo) > 96 or any("--" in p or ".." in p for p in parts):
        raise BadUri(f"{text}: {repo!r} is not a hub repository name (no '--' or '..', <= 96)")
    if at and (not revision or any(c.isspace() for c in revision)):
        raise BadUri(f"{text}: give a branch, tag or commit after '@', e.g. @main")
    return HubSource(repo, revision or "main")


def _s3(text: str, rest: str) -> S3Source:
    bucket, _, prefix = rest.partition("/")
    if not _BUCKET.match(bucket) or ".." in bucket:
        raise BadUri(
            f"{text}: {bucket!r} is not a bucket name (3-63 lowercase letters, digits, '.' "
            "and '-'); give s3://BUCKET/PREFIX, e.g. s3://models/flux-dev"
        )
    prefix = prefix.strip("/")
    if any(part in ("", ".", "..") for part in prefix.split("/")) and prefix:
        raise BadUri(f"{text}: the prefix has an empty, '.' or '..' part")
    return S3Source(bucket, prefix + "/" if prefix else "")


def _redacted(text: str) -> str:
    scheme, _, rest = text.partition("://")
    where = rest.partition("@")[2]
    return f"{scheme}://***@{where}" if where else f"{scheme}://***"
