"""A real hub-API server for tests of ``hf://`` sources: olah (installed by
tests/hub/setup.sh) serving git repositories made here, with no upstream, so the real
``huggingface_hub`` download code runs against ``HF_ENDPOINT``.

Each repository is a git work tree whose weights git-lfs stores as the hub does
(pointer files in git, objects under ``.git/lfs``); olah's local-mirror feature serves
it. What that proves and what it does not: docs/testing.md, "The hub server".

``huggingface_hub`` reads ``HF_ENDPOINT`` once, when it is imported: code in this
process passes ``endpoint=hub.endpoint``; a child process gets ``hub.env()``.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from dpserve.plumbing.ports import free_port
from tests.polling import eventually

SETUP = Path(__file__).with_name("setup.sh")
TINY_REPO = "dpserve/tiny"
# What the hub's default .gitattributes sends to LFS, for the files a pipeline holds.
LFS_PATTERNS = ("*.safetensors", "*.bin", "*.pt", "*.pth", "*.ckpt", "*.gguf", "*.onnx")
START_TIMEOUT_S = 60.0
_IDENTITY = {
    "GIT_AUTHOR_NAME": "dpserve tests",
    "GIT_AUTHOR_EMAIL": "tests@dpserve.dev",
    "GIT_COMMITTER_NAME": "dpserve tests",
    "GIT_COMMITTER_EMAIL": "tests@dpserve.dev",
    # The machine's own git settings (signing, hooks, templates) stay out of the repos.
    "GIT_CONFIG_GLOBAL": os.devnull,
    "GIT_CONFIG_NOSYSTEM": "1",
}


@dataclass(frozen=True)
class RepoSpec:
    """A model repository to publish: one commit per folder, oldest first, each the whole
    tree of its commit; ``main`` ends at the last. Tags and other branches name a commit
    by its index in ``folders``."""

    repo_id: str
    folders: Sequence[Path]
    tags: Mapping[str, int] = field(default_factory=lambda: {"v1": 0})
    branches: Mapping[str, int] = field(default_factory=lambda: {"release": 0})


@dataclass(frozen=True)
class PublishedRepo:
    repo_id: str
    path: Path  # the git work tree the server reads
    commits: tuple[str, ...]  # oldest first; main is the last
    refs: Mapping[str, str]  # every branch (main included) and tag -> its commit

    @property
    def main(self) -> str:
        return self.commits[-1]

    def lfs_object(self, filename: str, revision: str = "main") -> Path:
        """Where git-lfs keeps ``filename``'s bytes at ``revision`` (a commit, branch or tag)."""
        pointer = _git(self.path, "cat-file", "-p", f"{revision}:{filename}")
        oids = [line.split(":", 1)[1] for line in pointer.splitlines() if line.startswith("oid ")]
        if not oids:
            raise ValueError(f"{self.repo_id}:{filename} at {revision} is not stored in git-lfs")
        oid = oids[0]
        return self.path / ".git" / "lfs" / "objects" / oid[:2] / oid[2:4] / oid

    def corrupt(self, filename: str, revision: str = "main") -> None:
        """Flip one byte in the middle of ``filename``'s stored object: same size, other
        digest, served as it is (what a bad disk or a bad upload leaves). Every commit
        that shares those bytes serves the corrupt copy."""
        obj = self.lfs_object(filename, revision)
        with obj.open("r+b") as f:
            f.seek(obj.stat().st_size // 2)
            byte = f.read(1)
            f.seek(-1, os.SEEK_CUR)
            f.write(bytes([byte[0] ^ 0xFF]))


@dataclass(frozen=True)
class Hub:
    endpoint: str  # the value for HF_ENDPOINT
    repos: Mapping[str, PublishedRepo]

    @property
    def repo(self) -> PublishedRepo:
        """The one repository, where the hub serves one."""
        (only,) = self.repos.values()
        return only

    def env(self, home: Path) -> dict[str, str]:
        """A child process's environment: this hub, and ``home`` as its HF_HOME (its
        cache), so no test reads or fills the machine's own cache. Online, whatever this
        process inherited: a worker gang started here sets HF_HUB_OFFLINE=1 (and the
        images do)."""
        return {
            **os.environ,
            "HF_ENDPOINT": self.endpoint,
            "HF_HOME": str(home),
            "HF_HUB_OFFLINE": "0",
        }


def olah_command() -> Path:
    """olah's command, installed by tests/hub/setup.sh on first use (about 20-40 s, once)."""
    done = subprocess.run(
        ["bash", str(SETUP)],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHON": sys.executable},
        check=False,
    )
    if done.returncode != 0:
        raise RuntimeError(f"{SETUP} failed ({done.returncode}): {done.stderr.strip()}")
    return Path(done.stdout.strip().splitlines()[-1])


def _git(repo: Path, *args: str) -> str:
    done = subprocess.run(
        ["git", *args],
        cwd=repo,
        env={**os.environ, **_IDENTITY},
        capture_output=True,
        text=True,
        check=False,
    )
    if done.returncode != 0:
        raise RuntimeError(f"git {' '.join(args)} in {repo}: {done.stderr.strip()}")
    return done.stdout.strip()


def _replace_tree(work: Path, folder: Path) -> None:
    for entry in work.iterdir():
        if entry.name in (".git", ".gitattributes"):
            continue
        if entry.is_dir():
            shutil.rmtree(entry)
        else:
            entry.unlink()
    shutil.copytree(folder, work, dirs_exist_ok=True)


def publish(spec: RepoSpec, mirrors: Path) -> PublishedRepo:
    """``spec`` as a git repository where olah looks for it (``mirrors/models/ORG/NAME``)."""
    if not spec.folders:
        raise ValueError(f"{spec.repo_id}: a repository needs at least one folder")
    org, sep, name = spec.repo_id.partition("/")
    if not sep or not org or not name or "/" in name:
        raise ValueError(f"{spec.repo_id!r}: a repository id is ORG/NAME")
    work = mirrors / "models" / org / name
    work.mkdir(parents=True)
    _git(work, "init", "--quiet", "--initial-branch=main")
    _git(work, "lfs", "install", "--local")
    (work / ".gitattributes").write_text(
        "".join(f"{p} filter=lfs diff=lfs merge=lfs -text\n" for p in LFS_PATTERNS)
    )
    commits = []
    for i, folder in enumerate(spec.folders):
        _replace_tree(work, folder)
        # A fresh index hashes every file again: git's stat check would take a copied file
        # of the same size and the same mtime second for the one it replaced.
        (work / ".git" / "index").unlink(missing_ok=True)
        _git(work, "add", "--all")
        _git(work, "commit", "--quiet", "--allow-empty", "-m", f"revision {i} of {spec.repo_id}")
        commits.append(_git(work, "rev-parse", "HEAD"))
    for tag, index in spec.tags.items():
        _git(work, "tag", tag, commits[index])
    for branch, index in spec.branches.items():
        _git(work, "branch", branch, commits[index])
    refs = {"main": commits[-1]}
    refs |= {ref: commits[i] for ref, i in {**spec.tags, **spec.branches}.items()}
    return PublishedRepo(spec.repo_id, work, tuple(commits), refs)


def _config(workdir: Path, host: str, port: int, mirrors: Path) -> Path:
    """olah's settings: serve the local mirrors and never ask huggingface.co (offline)."""
    path = workdir / "olah.toml"
    path.write_text(
        "[basic]\n"
        f'host = "{host}"\n'
        f"port = {port}\n"
        f'repos-path = "{workdir / "cache"}"\n'
        f'mirrors-path = ["{mirrors}"]\n'
        "[accessibility]\n"
        "offline = true\n"
    )
    return path


@contextmanager
def serve_hub(workdir: Path, specs: Sequence[RepoSpec], host: str = "127.0.0.1") -> Iterator[Hub]:
    """olah on a free port of ``host`` serving ``specs`` from ``workdir``; yields once every
    repository answers its ``main`` commit, stops the server on exit. Pods in their own
    network namespaces reach it on a bridge address, not on loopback."""
    olah = olah_command()
    mirrors = workdir / "mirrors"
    repos = {spec.repo_id: publish(spec, mirrors) for spec in specs}
    port = free_port(host)
    config = _config(workdir, host, port, mirrors)
    log_path = workdir / "olah.log"
    with log_path.open("wb") as log:
        cmd = [str(olah), "--config", str(config), "--log-path", str(workdir / "logs")]
        proc = subprocess.Popen(cmd, cwd=workdir, stdout=log, stderr=subprocess.STDOUT)
    hub = Hub(f"http://{host}:{port}", repos)
    try:
        _wait_serving(hub, proc, log_path)
        yield hub
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _wait_serving(hub: Hub, proc: subprocess.Popen[bytes], log: Path) -> None:
    def serving_or_dead() -> bool:
        if proc.poll() is not None:
            return True
        for repo in hub.repos.values():
            url = f"{hub.endpoint}/api/models/{repo.repo_id}/revision/main"
            if httpx.get(url, timeout=5).json().get("sha") != repo.main:
                return False
        return True

    eventually(serving_or_dead, START_TIMEOUT_S, "olah to serve the test repositories", 0.1)
    if proc.poll() is not None:
        tail = log.read_text(errors="replace")[-2000:]
        raise RuntimeError(f"olah exited with {proc.returncode}:\n{tail}")
