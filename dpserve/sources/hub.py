"""``hf://ORG/NAME[@REVISION]``: through huggingface_hub, with its download code, its
cache layout (under ``<model cache>/hf``) and its token handling (``HF_TOKEN``, or the
token file ``hf auth login`` writes; the endpoint from ``HF_ENDPOINT``). dpserve never
reads, passes or logs the token itself.

The revision is resolved to its commit first, and everything after is pinned to that
commit. Digests are the hub's own: the LFS SHA-256 of a large file, the git blob id
(SHA-1 of ``"blob <size>\\0"`` + bytes) of a small one. huggingface_hub downloads
beside (``.incomplete`` blobs, resumed after a kill) and links a snapshot folder; the
entry is published by the cache's marker once every file of the snapshot was checked.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from dpserve.sources import select
from dpserve.sources.digest import verify
from dpserve.sources.errors import DigestMismatch, SourceError
from dpserve.sources.plan import Digest, Plan, PlannedFile
from dpserve.sources.progress import Meter
from dpserve.sources.uri import HubSource

log = logging.getLogger("dpserve.sources")


def entry_name(source: HubSource) -> str:
    """``hf--ORG--NAME``: unique, since a repository name holds no ``--``."""
    return "hf--" + source.repo_id.replace("/", "--")


class HubStore:
    draws_own_bars = True  # huggingface_hub's tqdm, on a terminal

    def __init__(self, source: HubSource, cache_dir: Path, endpoint: str | None = None) -> None:
        self.source = source
        self.name = entry_name(source)
        self.cache_dir = cache_dir
        self.endpoint = endpoint  # None: huggingface_hub's (HF_ENDPOINT, else the hub)

    def plan(self) -> Plan:
        """The commit the revision names now, and the files at that commit: their sizes
        and digests from the repository's tree (the hub's LFS sha256 and blob ids)."""
        from huggingface_hub import HfApi, hf_hub_download
        from huggingface_hub.hf_api import RepoFile

        repo = self.source.repo_id
        with _hub_errors(self.source):
            api = HfApi(endpoint=self.endpoint)
            commit = str(api.model_info(repo, revision=self.source.revision).sha)
            tree = api.list_repo_tree(repo, revision=commit, recursive=True)
            listed = {f.path: f for f in tree if isinstance(f, RepoFile)}
            if select.INDEX not in listed:
                raise select.NotAPipeline(
                    f"{self.source} has no {select.INDEX} at its top: it is no diffusers "
                    "pipeline repository"
                )
            index_file = hf_hub_download(
                repo,
                select.INDEX,
                revision=commit,
                cache_dir=self.cache_dir,
                endpoint=self.endpoint,
            )
        index = select.read_index(Path(index_file).read_bytes())
        chosen = select.select(listed, index)
        files = tuple(_planned(listed[path]) for path in chosen.files)
        return Plan(str(self.source), commit, files)

    def fill(self, plan: Plan, staging: Path, meter: Meter) -> Path:
        """huggingface_hub's snapshot of the planned files at the planned commit, each
        file checked; returns the snapshot folder."""
        from huggingface_hub import snapshot_download

        with _hub_errors(self.source), _watching(self, plan, meter):
            folder = snapshot_download(
                self.source.repo_id,
                revision=plan.revision,
                cache_dir=self.cache_dir,
                allow_patterns=[_literal(f.path) for f in plan.files],
                endpoint=self.endpoint,
            )
        snapshot = Path(folder)
        for planned in plan.files:
            link = snapshot / planned.path
            try:
                verify(link.resolve(), planned, plan.source)
            except DigestMismatch:
                link.unlink(missing_ok=True)  # the blob it pointed at is gone: no dangling use
                raise
        return snapshot

    @property
    def _repo(self) -> Path:
        return self.cache_dir / ("models--" + self.source.repo_id.replace("/", "--"))

    def folder(self, root: Path, revision: str) -> Path:
        """Where a fill of ``revision`` (a commit) leaves the pipeline: huggingface_hub's
        snapshot of it (``root``: the model cache, whose ``hf`` is ``cache_dir``)."""
        return root / "hf" / self._repo.name / "snapshots" / revision

    def on_disk(self, plan: Plan) -> int:
        """Bytes of the plan's files that huggingface_hub holds now, whole or partial."""
        repo = self._repo
        snapshot = repo / "snapshots" / plan.revision
        done = 0
        for f in plan.files:
            with contextlib.suppress(OSError):
                done += (snapshot / f.path).stat().st_size
        for partial in (repo / "blobs").glob("*.incomplete"):
            with contextlib.suppress(OSError):
                done += partial.stat().st_size
        return min(done, plan.total_bytes)


def _planned(f: Any) -> PlannedFile:
    """A ``RepoFile`` of the tree: an LFS file by its sha256, a small one by its blob id."""
    if f.lfs is not None:
        return PlannedFile(f.path, int(f.lfs.size), Digest("sha256", f.lfs.sha256))
    if not f.blob_id or f.size is None:
        raise SourceError(f"the hub gave no size or blob id for {f.path}")
    return PlannedFile(f.path, int(f.size), Digest("git-sha1", f.blob_id))


def _literal(path: str) -> str:
    """``path`` as an fnmatch pattern that matches only itself."""
    return "".join(f"[{c}]" if c in "*?[]" else c for c in path)


@contextlib.contextmanager
def _watching(store: HubStore, plan: Plan, meter: Meter, every_s: float = 1.0) -> Iterator[None]:
    """Counts the bytes on disk while huggingface_hub downloads (it reports to its own
    bars only): the log lines and the progress file follow them."""
    stop = threading.Event()
    baseline = store.on_disk(plan)  # resumed: in place, not moved
    meter.add(baseline)

    def watch() -> None:
        seen = baseline
        while not stop.wait(every_s):
            now = store.on_disk(plan)
            if now > seen:
                meter.add(now - seen, now - seen)
                seen = now

    watcher = threading.Thread(target=watch, name="hub-progress", daemon=True)
    watcher.start()
    try:
        yield
    finally:
        stop.set()
        watcher.join()
    left = plan.total_bytes - meter.snapshot().done  # moved since the last look
    if left > 0:
        meter.add(left, left)


@contextlib.contextmanager
def _hub_errors(source: HubSource) -> Iterator[None]:
    """huggingface_hub's errors as ``SourceError``s that say what to check."""
    from huggingface_hub import errors

    try:
        yield
    except errors.GatedRepoError:
        raise SourceError(
            f"{source}: the repository is gated: accept its terms on the hub with the "
            "account whose token dpserve uses (HF_TOKEN or `hf auth login`)"
        ) from None
    except errors.RevisionNotFoundError:
        raise SourceError(
            f"{source}: no revision {source.revision!r} (give a branch, tag or commit)"
        ) from None
    except errors.RepositoryNotFoundError:
        raise SourceError(
            f"{source}: no such repository (or revision {source.revision!r}), or it is "
            "private: check both, and set HF_TOKEN (or run `hf auth login`) for a private one"
        ) from None
    except errors.EntryNotFoundError as exc:
        raise SourceError(f"{source}: a planned file is missing at that commit ({exc})") from None
    except errors.OfflineModeIsEnabled:
        raise SourceError(f"{source}: HF_HUB_OFFLINE is set: unset it to fetch") from None
    except (errors.HTTPError, errors.LocalEntryNotFoundError, OSError) as exc:  # HTTP, network
        if isinstance(exc, SourceError):
            raise
        raise SourceError(
            f"{source}: the hub could not be reached or refused ({type(exc).__name__}: "
            f"{str(exc).splitlines()[0] if str(exc) else ''}); is HF_ENDPOINT right?"
        ) from None


def forget(cache_dir: Path, revisions: Iterable[str]) -> None:
    """Drop pruned commits from huggingface_hub's cache (blobs no other keeps)."""
    from huggingface_hub import scan_cache_dir

    wanted = list(revisions)
    if wanted and cache_dir.is_dir():
        scan_cache_dir(cache_dir).delete_revisions(*wanted).execute()
