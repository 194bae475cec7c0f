"""The hub source's pure parts: digests from the hub's file metadata, patterns that
match one file, cache names (dpserve/sources/hub.py). Its downloads against a real
hub-API server: tests/hub."""

from __future__ import annotations

import fnmatch
import hashlib

from huggingface_hub.hf_api import RepoFile

from dpserve.sources.hub import _literal, _planned, entry_name
from dpserve.sources.plan import Digest, PlannedFile
from dpserve.sources.uri import HubSource


def test_an_lfs_file_is_checked_by_its_sha256_and_a_small_one_by_its_git_blob_id() -> None:
    lfs = {"size": 10, "oid": "ab" * 32, "pointerSize": 130}  # as the tree API answers
    big = RepoFile(path="vae/w.safetensors", size=10, oid="c" * 40, lfs=lfs, type="file")
    assert _planned(big) == PlannedFile("vae/w.safetensors", 10, Digest("sha256", "ab" * 32))
    data = b'{"_class_name": "X"}'
    blob = hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()
    small = RepoFile(path="model_index.json", size=len(data), oid=blob, type="file")
    assert _planned(small) == PlannedFile("model_index.json", len(data), Digest("git-sha1", blob))


def test_a_literal_pattern_matches_only_its_file() -> None:
    for name in ("vae/config.json", "odd/[1]*?.json"):
        pattern = _literal(name)
        assert fnmatch.fnmatch(name, pattern)
        assert not fnmatch.fnmatch(name + "x", pattern) and not fnmatch.fnmatch("a", pattern)
    assert not fnmatch.fnmatch("odd/1ab.json", _literal("odd/[1]*?.json"))


def test_the_cache_name_of_a_repository() -> None:
    assert (
        entry_name(HubSource("black-forest-labs/FLUX.1-dev")) == "hf--black-forest-labs--FLUX.1-dev"
    )
