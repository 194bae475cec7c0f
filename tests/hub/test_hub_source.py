"""``hf://`` model sources through the real huggingface_hub against a real hub-API
server (olah, tests/hub/server.py): the revision pinned to its commit, the hub's digests
checked, a corrupt object refused by name, entries per commit, ``dpserve fetch`` and
``dpserve serve --model hf://…`` (dpserve/sources/hub.py)."""

from __future__ import annotations

import base64
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from dpserve.sources.cache import ModelCache
from dpserve.sources.errors import DigestMismatch, SourceError
from dpserve.sources.fetch import fetch_into, prune
from dpserve.sources.hub import HubStore
from dpserve.sources.uri import HubSource
from tests.hub.server import TINY_REPO, Hub, RepoSpec, serve_hub
from tests.servers import ServeProcess

pytestmark = pytest.mark.e2e

WEIGHTS = "transformer/diffusion_pytorch_model.safetensors"


def _files(folder: Path) -> dict[str, bytes]:
    return {
        p.relative_to(folder).as_posix(): p.read_bytes() for p in folder.rglob("*") if p.is_file()
    }


def _fetch(hub: Hub, revision: str, cache: ModelCache, said: list[str] | None = None) -> Path:
    store = HubStore(HubSource(TINY_REPO, revision), cache.root / "hf", endpoint=hub.endpoint)
    return fetch_into(store, cache, (said if said is not None else []).append, bar=False)


def test_a_tag_is_pinned_to_its_commit_and_every_file_checked(
    hub_server: Hub, tiny_model: Path, tmp_path: Path
) -> None:
    cache = ModelCache(tmp_path / "cache")
    said: list[str] = []
    folder = _fetch(hub_server, "v1", cache, said)
    commit = hub_server.repo.refs["v1"]
    assert folder == cache.root / "hf" / "models--dpserve--tiny" / "snapshots" / commit
    assert _files(folder) == _files(tiny_model)  # the pipeline, and nothing else
    total = sum(len(b) for b in _files(tiny_model).values())
    assert said == [f"plan: hf://{TINY_REPO}@v1 at {commit}: {len(_files(tiny_model))} files, "
                    f"{said[0].split(', ', 1)[1]}"]  # fmt: skip
    assert f"({total} bytes)" in said[0]
    entry = cache.root / "entries" / "hf--dpserve--tiny" / commit
    record = json.loads((entry / "entry.json").read_text())
    kinds = {f["path"]: f["digest"] for f in record["files"]}
    assert kinds[WEIGHTS] == "sha256" and kinds["model_index.json"] == "git-sha1"
    assert record["folder"] == f"hf/models--dpserve--tiny/snapshots/{commit}"
    progress = json.loads(entry.with_name(commit + ".progress.json").read_text())
    assert progress["state"] == "ready" and progress["bytes_done"] == total
    # Again: the same entry, reused; pinned to the commit, it needs no hub at all.
    assert _fetch(hub_server, commit, cache) == folder
    dead = {"HF_ENDPOINT": "http://127.0.0.1:9", "HF_HUB_OFFLINE": "1"}
    pinned = [sys.executable, "-m", "dpserve", "fetch", f"hf://{TINY_REPO}@{commit}"]
    done = subprocess.run(
        [*pinned, "--model-cache", str(cache.root)],
        env={**os.environ, **dead},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0 and done.stdout.strip() == str(folder), done.stderr


def test_each_commit_is_its_own_entry_and_old_ones_are_pruned(
    hub_server: Hub, tiny_model: Path, tiny_model_b: Path, tmp_path: Path
) -> None:
    cache = ModelCache(tmp_path / "cache")
    old = _fetch(hub_server, "release", cache)
    new = _fetch(hub_server, "main", cache)
    assert old != new and _files(new) == _files(tiny_model_b) and _files(old) == _files(tiny_model)
    removed = prune(f"hf://{TINY_REPO}", cache.root, keep=1)
    assert [e.revision for e in removed] == [hub_server.repo.refs["release"]]
    assert [e.revision for e, _ in cache.entries("hf--dpserve--tiny")] == [hub_server.repo.main]
    assert not old.exists() and new.is_dir()  # huggingface_hub's snapshot went too


def test_a_missing_revision_is_a_clear_error(hub_server: Hub, tmp_path: Path) -> None:
    with pytest.raises(SourceError, match="or revision 'nope'"):
        _fetch(hub_server, "nope", ModelCache(tmp_path))


def test_a_corrupt_file_is_refused_by_name_and_never_published(
    tiny_model: Path, tmp_path: Path
) -> None:
    with serve_hub(tmp_path / "hub", [RepoSpec(TINY_REPO, (tiny_model,))]) as hub:
        hub.repo.corrupt(WEIGHTS)
        cache = ModelCache(tmp_path / "cache")
        with pytest.raises(DigestMismatch) as refused:
            _fetch(hub, "v1", cache)
    assert f"{WEIGHTS} from hf://{TINY_REPO}@v1 is corrupt" in str(refused.value)
    assert not list(cache.root.glob("entries/*/*/entry.json"))
    snapshot = cache.root / "hf" / "models--dpserve--tiny" / "snapshots" / hub.repo.refs["v1"]
    assert not (snapshot / WEIGHTS).exists()  # neither the link nor its blob remain


def test_dpserve_fetch_and_serve_through_hf_endpoint(
    hub_server: Hub, tiny_model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    env = hub_server.env(tmp_path / "hf-home")
    cache = tmp_path / "cache"
    cmd = [sys.executable, "-m", "dpserve", "fetch", f"hf://{TINY_REPO}@v1"]
    done = subprocess.run(
        [*cmd, "--model-cache", str(cache)], env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    lines = done.stdout.strip().splitlines()
    assert lines[0].startswith(f"plan: hf://{TINY_REPO}@v1 at {hub_server.repo.refs['v1']}")
    assert _files(Path(lines[-1])) == _files(tiny_model)
    for name in ("HF_ENDPOINT", "HF_HOME"):
        monkeypatch.setenv(name, env[name])
    with ServeProcess(f"hf://{TINY_REPO}@v1", 1, "--model-cache", str(cache)) as serve:
        reply = serve.http.post(
            "/v1/images/generations",
            json={"prompt": "a kite", "size": "64x64", "num_inference_steps": 2, "seed": 3},
        )
        assert reply.status_code == 200, reply.text
        assert base64.b64decode(reply.json()["data"][0]["b64_json"]).startswith(b"\x89PNG")
        assert serve.http.get("/v1/models").json()["data"][0]["id"] == TINY_REPO


def test_two_concurrent_fetches_download_once(
    hub_server: Hub, tiny_model: Path, tmp_path: Path
) -> None:
    from tests.storage.proxy import CountingProxy

    total = sum(len(b) for b in _files(tiny_model).values())
    cache = tmp_path / "cache"
    with CountingProxy(hub_server.endpoint, rate_bytes_per_s=2 << 20) as proxy:  # ~2.5 s
        token = "hf_dpserveTestTokenNeverShown"  # olah checks none; it must show nowhere
        env = {**hub_server.env(tmp_path / "hf-home"), "HF_ENDPOINT": proxy.url, "HF_TOKEN": token}
        cmd = [sys.executable, "-m", "dpserve", "fetch", f"hf://{TINY_REPO}@release"]
        fetches = [
            subprocess.Popen(
                [*cmd, "--model-cache", str(cache)],
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
            for _ in range(2)
        ]
        outputs = [f.communicate(timeout=120) for f in fetches]
        assert [f.returncode for f in fetches] == [0, 0], outputs
        moved = proxy.sent
    assert len({out.strip().splitlines()[-1] for out, _ in outputs}) == 1
    # One model's bytes (plus two plans' API answers and headers), not two models'.
    assert total <= moved < total + 256 * 1024, (moved, total)
    assert sum("waiting for it" in err for _, err in outputs) == 1
    written = [p.read_text() for p in cache.rglob("*.json") if "/hf/" not in str(p)]
    assert not [t for t in [*written, *(o for pair in outputs for o in pair)] if token in t]


def test_a_killed_fetch_publishes_nothing_and_the_next_one_completes(
    hub_server: Hub, tiny_model: Path, tmp_path: Path
) -> None:
    from tests.polling import eventually
    from tests.storage.proxy import CountingProxy

    cache = tmp_path / "cache"
    cmd = [sys.executable, "-m", "dpserve", "fetch", f"hf://{TINY_REPO}@v1"]
    cmd += ["--model-cache", str(cache)]
    with CountingProxy(hub_server.endpoint, rate_bytes_per_s=512 << 10) as proxy:
        env = {**hub_server.env(tmp_path / "hf-home"), "HF_ENDPOINT": proxy.url}
        first = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        eventually(lambda: proxy.sent > 1 << 20, 60, "a megabyte of the first fetch")
        first.kill()
        first.wait(10)
        assert not list(cache.glob("entries/*/*/entry.json"))  # nothing published
        proxy.rate = None
        done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert _files(Path(done.stdout.strip().splitlines()[-1])) == _files(tiny_model)


def test_a_private_repository_takes_huggingface_hubs_token_and_never_shows_it(
    tiny_model: Path, tmp_path: Path
) -> None:
    token = "hf_dpserveTestPrivateToken"
    cache = tmp_path / "cache"
    fetch = [sys.executable, "-m", "dpserve", "fetch", "hf://dpserve/private@v1"]
    fetch += ["--model-cache", str(cache)]
    with serve_hub(
        tmp_path / "hub", [RepoSpec("dpserve/private", (tiny_model,))], token=token
    ) as hub:
        home = tmp_path / "hf-home"
        without = {k: v for k, v in hub.env(home).items() if k != "HF_TOKEN"}
        refused = subprocess.run(fetch, env=without, capture_output=True, text=True, timeout=120)
        assert refused.returncode == 1 and "set HF_TOKEN" in refused.stderr, refused.stderr
        # The token file `hf auth login` writes (under HF_HOME), then HF_TOKEN.
        home.mkdir(exist_ok=True)
        (home / "token").write_text(token)
        by_file = subprocess.run(fetch, env=without, capture_output=True, text=True, timeout=120)
        assert by_file.returncode == 0, by_file.stderr
        (home / "token").unlink()
        shutil.rmtree(cache)
        by_env = subprocess.run(
            fetch, env=hub.env(home), capture_output=True, text=True, timeout=120
        )
        assert by_env.returncode == 0, by_env.stderr
    assert _files(Path(by_env.stdout.strip().splitlines()[-1])) == _files(tiny_model)
    ours = [p.read_text() for p in cache.rglob("*.json") if "/hf/" not in str(p)]
    outputs = [o for done in (refused, by_file, by_env) for o in (done.stdout, done.stderr)]
    assert not [text for text in [*ours, *outputs] if token in text]


def test_a_pin_names_the_commit_and_the_snapshot_a_node_fetch_then_fills(
    hub_server: Hub, tmp_path: Path
) -> None:
    """A node-local cache's two steps against the hub (docs/models.md, Node-local
    caches): ``--pin`` resolves the tag to its commit and names the snapshot folder
    without writing under the cache; the node's fetch of the pinned URI fills exactly it."""
    cache = tmp_path / "cache"
    env = {**os.environ, "HF_ENDPOINT": hub_server.endpoint, "HF_HUB_OFFLINE": "0"}
    pin = subprocess.run(
        [sys.executable, "-m", "dpserve", "fetch", f"hf://{TINY_REPO}@v1",
         "--model-cache", str(cache), "--pin", "--result-file", str(tmp_path / "pin.json")],
        env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert pin.returncode == 0, pin.stderr
    pinned = json.loads((tmp_path / "pin.json").read_text())
    commit = hub_server.repo.refs["v1"]
    assert (pinned["state"], pinned["revision"]) == ("pinned", commit)
    assert pinned["fetch"] == f"hf://{TINY_REPO}@{commit}"
    assert pinned["folder"] == str(cache / "hf" / "models--dpserve--tiny" / "snapshots" / commit)
    assert not cache.exists()
    fetched = subprocess.run(
        [sys.executable, "-m", "dpserve", "fetch", pinned["fetch"], "--model-cache", str(cache),
         "--expect-revision", commit, "--prune-keep", "1"],
        env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert fetched.returncode == 0, fetched.stderr
    assert fetched.stdout.splitlines()[-1] == pinned["folder"]
