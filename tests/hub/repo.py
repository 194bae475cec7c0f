"""Model repositories as the hub stores them: git, with weights in git-lfs (pointer files
in git, the bytes under ``.git/lfs``), in the folder layout olah's local mirror reads."""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

# What the hub's default .gitattributes sends to LFS, for the files a pipeline holds.
LFS_PATTERNS = ("*.safetensors", "*.bin", "*.pt", "*.pth", "*.ckpt", "*.gguf", "*.onnx")
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


def _replace_tree(work: Path, folder: Path) -> None:
    for entry in work.iterdir():
        if entry.name in (".git", ".gitattributes"):
            continue
        if entry.is_dir():
            shutil.rmtree(entry)
        else:
            entry.unlink()
    shutil.copytree(folder, work, dirs_exist_ok=True)


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
