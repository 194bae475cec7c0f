"""The hub server (tests/hub/server.py) answers the real ``huggingface_hub`` the way the
hub does, for the calls an hf:// source makes; the tests named for a gap pin what it
does not do (docs/testing.md, "The hub server"), so a change of olah shows up here."""

from __future__ import annotations

import hashlib
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from huggingface_hub import (
    HfApi,
    get_hf_file_metadata,
    hf_hub_download,
    hf_hub_url,
    snapshot_download,
)
from huggingface_hub.errors import RepositoryNotFoundError
from huggingface_hub.hf_api import RepoFile

from tests.hub.server import TINY_REPO, Hub, RepoSpec, serve_hub

pytestmark = pytest.mark.e2e

WEIGHTS = "transformer/diffusion_pytorch_model.safetensors"
CONFIG = "model_index.json"


def _files(folder: Path) -> dict[str, bytes]:
    return {
        p.relative_to(folder).as_posix(): p.read_bytes() for p in folder.rglob("*") if p.is_file()
    }


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _git_blob_id(data: bytes) -> str:
    """The id git gives a file's bytes: what the hub reports for a file not in LFS."""
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def _api(hub: Hub) -> HfApi:
    return HfApi(endpoint=hub.endpoint, token=False)


def test_branches_and_tags_resolve_to_their_commits(hub_server: Hub) -> None:
    repo, api = hub_server.repo, _api(hub_server)
    first, second = repo.commits
    assert first != second
    assert repo.refs == {"main": second, "v1": first, "release": first}
    for revision, commit in [("main", second), ("v1", first), ("release", first)]:
        assert api.model_info(TINY_REPO, revision=revision).sha == commit, revision
    assert api.model_info(TINY_REPO, revision=first).sha == first
    refs = api.list_repo_refs(TINY_REPO)
    assert {(b.name, b.target_commit) for b in refs.branches} == {
        ("main", second),
        ("release", first),
    }
    assert {(t.name, t.target_commit) for t in refs.tags} == {("v1", first)}


def test_the_tree_lists_every_file_with_its_size_and_lfs_sha256(
    hub_server: Hub, tiny_model: Path, tiny_model_b: Path
) -> None:
    api = _api(hub_server)
    for folder, commit in zip((tiny_model, tiny_model_b), hub_server.repo.commits, strict=True):
        want = _files(folder)
        tree = {
            f.path: f
            for f in api.list_repo_tree(TINY_REPO, revision=commit, recursive=True)
            if isinstance(f, RepoFile)
        }
        assert set(tree) == {*want, ".gitattributes"}
        assert set(api.list_repo_files(TINY_REPO, revision=commit)) == set(tree)
        for path, data in want.items():
            entry = tree[path]
            assert entry.size == len(data), path
            if path.endswith(".safetensors"):
                assert entry.lfs is not None and entry.lfs.sha256 == _sha256(data), path
            else:
                assert entry.lfs is None and entry.blob_id == _git_blob_id(data), path
        (info,) = api.get_paths_info(TINY_REPO, [WEIGHTS], revision=commit)
        assert isinstance(info, RepoFile) and info.lfs is not None
        assert info.lfs.sha256 == _sha256(want[WEIGHTS])


def test_gap_model_info_names_files_but_gives_no_sizes_or_digests(
    hub_server: Hub, tiny_model_b: Path
) -> None:
    """The hub answers ``files_metadata=True`` with each file's size and LFS sha256; olah's
    local mirror names the files only (the tree above has both)."""
    info = _api(hub_server).model_info(TINY_REPO, revision="main", files_metadata=True)
    assert info.siblings is not None
    assert {s.rfilename for s in info.siblings} == {*_files(tiny_model_b), ".gitattributes"}
    assert all(s.size is None and s.lfs is None for s in info.siblings)


def test_gap_model_info_without_a_revision_is_repository_not_found(hub_server: Hub) -> None:
    """Offline, olah resolves the revision-less route from its proxy cache, never from a
    local mirror: pass ``revision="main"`` (hf_hub_download and snapshot_download do)."""
    with pytest.raises(RepositoryNotFoundError):
        _api(hub_server).model_info(TINY_REPO)


def test_a_head_answers_the_commit_etag_and_size(hub_server: Hub, tiny_model: Path) -> None:
    want = _files(tiny_model)
    for path, etag in [(WEIGHTS, _sha256(want[WEIGHTS])), (CONFIG, _git_blob_id(want[CONFIG]))]:
        url = hf_hub_url(TINY_REPO, path, revision="v1", endpoint=hub_server.endpoint)
        meta = get_hf_file_metadata(url, token=False)
        assert (meta.commit_hash, meta.etag, meta.size) == (
            hub_server.repo.commits[0],
            etag,
            len(want[path]),
        )


def test_gap_a_weight_file_is_served_in_place_with_no_linked_headers(hub_server: Hub) -> None:
    """The hub redirects a weight file's resolve to its CDN and names the LFS object in
    X-Linked-Etag and X-Linked-Size; olah answers it itself with ETag and Content-Length."""
    url = hf_hub_url(TINY_REPO, WEIGHTS, endpoint=hub_server.endpoint)
    head = httpx.head(url, follow_redirects=False, timeout=30)
    assert head.status_code == 200
    assert "location" not in head.headers
    assert not any(name.startswith("x-linked-") for name in head.headers)


def test_hf_hub_download_fills_the_cache_layout_at_a_pinned_revision(
    hub_server: Hub, tiny_model: Path, tiny_model_b: Path, tmp_path: Path
) -> None:
    first, second = hub_server.repo.commits
    for revision, commit, folder in [("v1", first, tiny_model), ("main", second, tiny_model_b)]:
        got = Path(
            hf_hub_download(
                TINY_REPO,
                WEIGHTS,
                revision=revision,
                cache_dir=tmp_path,
                endpoint=hub_server.endpoint,
                token=False,
            )
        )
        data = (folder / WEIGHTS).read_bytes()
        assert got.read_bytes() == data
        snapshot = tmp_path / "models--dpserve--tiny" / "snapshots" / commit
        assert got == snapshot / WEIGHTS
        assert got.resolve() == tmp_path / "models--dpserve--tiny" / "blobs" / _sha256(data)
        refs = tmp_path / "models--dpserve--tiny" / "refs" / revision
        assert refs.read_text() == commit


def test_snapshot_download_fetches_only_the_allowed_files(
    hub_server: Hub, tiny_model_b: Path, tmp_path: Path
) -> None:
    patterns = ["*.json", "transformer/*"]
    planned = snapshot_download(
        TINY_REPO,
        allow_patterns=patterns,
        cache_dir=tmp_path,
        endpoint=hub_server.endpoint,
        token=False,
        dry_run=True,
    )
    folder = Path(
        snapshot_download(
            TINY_REPO,
            allow_patterns=patterns,
            cache_dir=tmp_path,
            endpoint=hub_server.endpoint,
            token=False,
        )
    )
    want = {
        path: data
        for path, data in _files(tiny_model_b).items()
        if path.endswith(".json") or path.startswith("transformer/")
    }
    assert _files(folder) == want
    assert folder.name == hub_server.repo.main
    # The total is known before a byte is fetched.
    assert {p.filename: p.file_size for p in planned} == {p: len(d) for p, d in want.items()}


def test_gap_a_range_request_gets_the_whole_file_and_the_client_restarts_it(
    hub_server: Hub, tiny_model_b: Path, tmp_path: Path
) -> None:
    """The hub answers a Range with 206; olah's local mirror sends the whole file (200), so a
    resumed download starts again from byte 0 (huggingface_hub handles that, this shows)."""
    data = (tiny_model_b / WEIGHTS).read_bytes()
    url = hf_hub_url(TINY_REPO, WEIGHTS, endpoint=hub_server.endpoint)
    answer = httpx.get(url, headers={"Range": "bytes=100-"}, timeout=30)
    assert (answer.status_code, answer.content) == (200, data)
    # A partial download left behind, half of it garbage: the resumed one still ends right.
    blobs = tmp_path / "models--dpserve--tiny" / "blobs"
    blobs.mkdir(parents=True)
    (blobs / f"{_sha256(data)}.incomplete").write_bytes(b"\0" * (len(data) // 2))
    got = hf_hub_download(
        TINY_REPO, WEIGHTS, cache_dir=tmp_path, endpoint=hub_server.endpoint, token=False
    )
    assert Path(got).read_bytes() == data


def test_gap_olah_checks_no_token(hub_server: Hub, tmp_path: Path) -> None:
    """Every repository is public to olah's local mirror: a wrong token downloads as well as
    none. A private repository needs the gate in front (the next test)."""
    got = hf_hub_download(
        TINY_REPO, CONFIG, cache_dir=tmp_path, endpoint=hub_server.endpoint, token="hf_wrong"
    )
    assert Path(got).is_file()
    info = HfApi(endpoint=hub_server.endpoint, token="hf_wrong").model_info(
        TINY_REPO, revision="main"
    )
    assert info.private is False


def test_a_private_repository_answers_only_with_its_token(tiny_model: Path, tmp_path: Path) -> None:
    token = "hf_test_private_token"
    spec = RepoSpec("dpserve/private", (tiny_model,))
    with serve_hub(tmp_path / "hub", [spec], token=token) as hub:

        def download(name: str, token: str | bool, cache: str) -> Path:
            return Path(
                hf_hub_download(
                    "dpserve/private",
                    name,
                    cache_dir=tmp_path / cache,
                    endpoint=hub.endpoint,
                    token=token,
                )
            )

        assert download(WEIGHTS, token, "a").read_bytes() == (tiny_model / WEIGHTS).read_bytes()
        for wrong in (False, "hf_wrong_token"):
            with pytest.raises(RepositoryNotFoundError):
                download(CONFIG, wrong, "b")
            with pytest.raises(RepositoryNotFoundError):
                HfApi(endpoint=hub.endpoint, token=wrong).model_info(
                    "dpserve/private", revision="main"
                )
        # HF_TOKEN in the environment is what the hf command sends (each run its own cache:
        # the client answers from its cache when the hub refuses).
        cmd = [str(Path(sys.executable).with_name("hf")), "download", "dpserve/private"]
        cmd += [CONFIG, "--quiet"]
        env = hub.env(tmp_path / "with")
        done = subprocess.run(cmd, env=env, capture_output=True, timeout=120, check=False)
        assert done.returncode == 0, done.stderr
        env = {**hub.env(tmp_path / "without")}
        del env["HF_TOKEN"]
        done = subprocess.run(cmd, env=env, capture_output=True, timeout=120, check=False)
        assert done.returncode != 0
        said = (done.stderr + done.stdout).decode().lower()
        assert "not found" in said and "token" in said, said


def test_gap_a_missing_file_or_revision_reads_as_a_missing_repository(
    hub_server: Hub, tmp_path: Path
) -> None:
    """The hub answers 404 EntryNotFound and RevisionNotFound; olah answers 401 RepoNotFound
    (and a GET of a missing file, 500)."""
    with pytest.raises(RepositoryNotFoundError):
        hf_hub_download(
            TINY_REPO, "nope.json", cache_dir=tmp_path, endpoint=hub_server.endpoint, token=False
        )
    with pytest.raises(RepositoryNotFoundError):
        _api(hub_server).model_info(TINY_REPO, revision="nope")
    missing = hf_hub_url(TINY_REPO, "nope.json", endpoint=hub_server.endpoint)
    assert httpx.get(missing, timeout=30).status_code == 500


def test_gap_the_client_cannot_list_commits(hub_server: Hub) -> None:
    """olah's commit authors carry no ``user``, which the client reads."""
    with pytest.raises(KeyError, match="user"):
        _api(hub_server).list_repo_commits(TINY_REPO)


def test_the_hf_command_downloads_through_hf_endpoint(
    hub_server: Hub, tiny_model: Path, tmp_path: Path
) -> None:
    hf = Path(sys.executable).with_name("hf")
    cmd = [str(hf), "download", TINY_REPO, CONFIG, WEIGHTS, "--revision", "v1", "--quiet"]
    done = subprocess.run(
        cmd, env=hub_server.env(tmp_path), capture_output=True, text=True, timeout=120, check=False
    )
    assert done.returncode == 0, done.stderr
    snapshot = Path(done.stdout.strip().splitlines()[-1])
    assert (
        snapshot
        == tmp_path / "hub" / "models--dpserve--tiny" / "snapshots" / (hub_server.repo.commits[0])
    )
    assert _files(snapshot) == {p: _files(tiny_model)[p] for p in (CONFIG, WEIGHTS)}


def test_a_corrupt_object_is_served_as_it_is_and_only_its_digest_tells(
    tiny_model: Path, tmp_path: Path
) -> None:
    """What an hf:// source must catch itself: the download succeeds with the right size
    and the wrong bytes; the tree still names the sha256 the file should have."""
    with serve_hub(tmp_path / "hub", [RepoSpec("dpserve/bad", (tiny_model,))]) as hub:
        hub.repo.corrupt(WEIGHTS)
        got = Path(
            hf_hub_download(
                "dpserve/bad",
                WEIGHTS,
                revision="v1",
                cache_dir=tmp_path / "cache",
                endpoint=hub.endpoint,
                token=False,
            )
        ).read_bytes()
        (info,) = _api(hub).get_paths_info("dpserve/bad", [WEIGHTS], revision="v1")
    want = (tiny_model / WEIGHTS).read_bytes()
    assert len(got) == len(want) and got != want
    assert isinstance(info, RepoFile) and info.lfs is not None
    assert info.lfs.sha256 == _sha256(want) != _sha256(got)
