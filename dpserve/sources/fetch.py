"""``--model`` to a local pipeline folder: a local folder as it is; a hub repository or a
bucket prefix planned (the total said before any byte moves), then fetched into the
model cache once, verified, and published (``cache.ModelCache``)."""

from __future__ import annotations

import json
import logging
import sys
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from dpserve.sources.cache import MARKER, Entry, ModelCache, default_root
from dpserve.sources.errors import (
    EXIT_FAILED,
    EXIT_REFUSED,
    DigestMismatch,
    RevisionChanged,
    SourceError,
)
from dpserve.sources.plan import Plan
from dpserve.sources.progress import JsonLinesSink, Meter, Sink, default_sinks
from dpserve.sources.select import NotAPipeline
from dpserve.sources.uri import BadUri, HubSource, LocalSource, S3Source, Source, parse

log = logging.getLogger("dpserve.sources")


class Store(Protocol):
    name: str  # the source's folder in the cache
    draws_own_bars: bool  # the hub's client shows its own (huggingface_hub's tqdm)

    def plan(self) -> Plan: ...

    def folder(self, root: Path, revision: str) -> Path: ...

    def fill(self, plan: Plan, staging: Path, meter: Meter) -> Path: ...


def store_of(source: HubSource | S3Source, cache: ModelCache) -> Store:
    if isinstance(source, S3Source):
        from dpserve.sources.s3 import S3Store

        return S3Store(source)
    from dpserve.sources.hub import HubStore

    return HubStore(source, cache.root / "hf")


@dataclass(frozen=True)
class Fetched:
    """A published cache entry: the pipeline folder and what it holds."""

    folder: Path
    plan: Plan

    def to_json(self) -> dict[str, Any]:
        return {
            "state": "ready",
            "source": self.plan.source,
            "revision": self.plan.revision,
            "folder": str(self.folder),
            "bytes_total": self.plan.total_bytes,
            "files": len(self.plan.files),
        }


def local_folder(
    model: str,
    cache_root: Path | None = None,
    say: Callable[[str], None] = lambda text: log.info("%s", text),
    bar: bool = True,
) -> Path:
    """The pipeline folder ``model`` names, fetched first when it is a URI."""
    source: Source = parse(model)
    if isinstance(source, LocalSource):
        return source.path
    return fetched(source, cache_root, say, bar).folder


def fetched(
    source: HubSource | S3Source,
    cache_root: Path | None = None,
    say: Callable[[str], None] = lambda text: log.info("%s", text),
    bar: bool = True,
    sinks: Sequence[Sink] = (),
    expect: str | None = None,
) -> Fetched:
    """``source``'s cache entry, filled first unless it is ready. ``expect``: the
    revision it was pinned to; a source now at another is refused (``RevisionChanged``)."""
    cache = ModelCache(cache_root or default_root())
    store = store_of(source, cache)
    if expect is None and isinstance(source, HubSource) and is_commit(source.revision):
        expect = source.revision
    if expect is not None:
        # Pinned (as every replica of a rolled-out revision is): a ready entry needs no
        # store, so replicas start while the hub or the bucket is down.
        entry = Entry(cache.root, store.name, expect)
        ready = cache.ready(entry)
        if ready is not None:
            return Fetched(ready, Plan.from_json(json.loads((entry.dir / MARKER).read_text())))
    plan = store.plan()
    say(f"plan: {plan.summary()}")
    if expect is not None and plan.revision != expect:
        raise RevisionChanged(
            f"{plan.source} is at {plan.revision} now, not at {expect}, the revision it was "
            "pinned to: its objects changed since; upload a changed model under a new prefix "
            "and point the source at it"
        )
    return Fetched(_fill_entry(store, cache, plan, bar, sinks), plan)


def pinned(model: str, cache_root: Path) -> dict[str, Any]:
    """What every node fetches of ``model``: the revision it resolves to now, the URI
    that names that revision (a hub source pinned to its commit), the pipeline folder
    its entry will have under ``cache_root`` and its size. The source is asked; nothing
    is written under ``cache_root`` (the hub's index download goes to a scratch folder)."""
    source = parse(model)
    if isinstance(source, LocalSource):
        raise SourceError(f"{model} is a local folder: there is nothing to fetch")
    with tempfile.TemporaryDirectory(prefix="dpserve-pin-") as scratch:
        plan = store_of(source, ModelCache(Path(scratch))).plan()
    cache = ModelCache(cache_root)
    at = HubSource(source.repo_id, plan.revision) if isinstance(source, HubSource) else source
    return {
        "state": "pinned",
        "source": plan.source,
        "revision": plan.revision,
        "fetch": str(at),
        "folder": str(store_of(source, cache).folder(cache.root, plan.revision)),
        "bytes_total": plan.total_bytes,
        "files": len(plan.files),
    }


def is_commit(revision: str) -> bool:
    return len(revision) == 40 and all(c in "0123456789abcdef" for c in revision)


def fetch_into(
    store: Store,
    cache: ModelCache,
    say: Callable[[str], None] = lambda text: log.info("%s", text),
    bar: bool = True,
) -> Path:
    """``store``'s plan, said before any byte moves, then its entry filled (or reused)."""
    plan = store.plan()
    say(f"plan: {plan.summary()}")
    return _fill_entry(store, cache, plan, bar)


def _fill_entry(
    store: Store, cache: ModelCache, plan: Plan, bar: bool, sinks: Sequence[Sink] = ()
) -> Path:
    entry = cache.entry(store.name, plan)
    return cache.fill(entry, plan, lambda p, staging: _fill(store, entry, p, staging, bar, sinks))


def _fill(
    store: Store, entry: Entry, plan: Plan, staging: Path, bar: bool, extra: Sequence[Sink]
) -> Path:
    sinks = [*default_sinks(log, entry.progress, bar and not store.draws_own_bars), *extra]
    meter = Meter(plan.source, plan.revision, plan.total_bytes, sinks)
    try:
        folder = store.fill(plan, staging, meter)
    except BaseException as exc:
        meter.finish(str(exc) if isinstance(exc, SourceError) else f"stopped: {exc!r}")
        raise
    meter.finish()
    return folder


def prune(
    model: str, cache_root: Path | None, keep: int, protect: frozenset[str] = frozenset()
) -> list[Entry]:
    """Remove ``model``'s cache entries but a revision in ``protect`` (the one replicas
    load) and the ``keep`` newest others, for a roll to call once it is done; a hub
    entry's snapshot goes from huggingface_hub's cache too."""
    source = parse(model)
    if isinstance(source, LocalSource):
        return []
    cache = ModelCache(cache_root or default_root())
    store = store_of(source, cache)
    removed = cache.prune(store.name, keep, protect)
    if isinstance(source, HubSource):
        from dpserve.sources.hub import forget

        forget(cache.root / "hf", [e.revision for e in removed])
    return removed


def prune_cache(cache_root: Path | None, keep: int, protect: Sequence[Path]) -> list[str]:
    """Remove every entry of the cache but the ``protect``ed pipeline folders and the
    ``keep`` newest others (``dpserve prune-cache``: a roll's clean-up); a hub entry's
    snapshot goes from huggingface_hub's cache too. Returns the removed entries'
    sources and revisions."""
    cache = ModelCache(cache_root or default_root())
    removed = cache.prune_all(keep, frozenset(protect))
    hub = [e.revision for e, r in removed if str(r.get("source", "")).startswith("hf://")]
    if hub:
        from dpserve.sources.hub import forget

        forget(cache.root / "hf", hub)
    return [f"{r.get('source')}@{e.revision}" for e, r in removed]


@dataclass(frozen=True)
class FetchOptions:
    """``dpserve fetch``'s switches beyond the model and the cache."""

    dry_run: bool = False
    json_lines: bool = False
    result_file: Path | None = None
    pin: bool = False
    expect_revision: str | None = None
    prune_keep: int | None = None


def fetch_main(model: str, cache_root: Path | None, opts: FetchOptions | None = None) -> int:
    """``dpserve fetch``: the plan first, progress on stderr, the folder last on stdout;
    with ``dry_run``, only the plan, as JSON (what a fill would move).

    ``json_lines``: stdout carries JSON objects only, one per line: progress snapshots
    (``"event": "progress"``) and the outcome last (``"event": "result"``), for a
    watcher reading a fill Job's log. ``result_file``: the outcome also goes there
    (a pod's termination message file), written whichever way the fetch ends.

    ``pin``: fetch nothing; the outcome is ``pinned`` (what every node of a node-local
    cache fetches). ``expect_revision``: refuse (exit 3) a source no longer at it.
    ``prune_keep``: once fetched, remove this source's other entries beyond the N
    newest (never one being filled)."""
    opts = opts or FetchOptions()
    json_lines, result_file = opts.json_lines, opts.result_file
    out: dict[str, Any]
    code = 0
    try:
        if opts.dry_run:
            print(json.dumps(plan_of(model, cache_root).to_json(), indent=1), flush=True)
            return 0
        if opts.pin:
            out = pinned(model, cache_root or default_root())
        else:
            out = _fetch(model, cache_root, opts)
    except SourceError as exc:
        print(f"dpserve fetch: {exc}", file=sys.stderr, flush=True)
        code = EXIT_FAILED if _transient(exc) else EXIT_REFUSED
        out = {
            "state": "failed",
            "source": model,
            "error": str(exc),
            "retried": code == EXIT_FAILED,
        }
    except Exception as exc:  # reported like the rest: a fill Job's status shows it
        print(f"dpserve fetch: {exc!r}", file=sys.stderr, flush=True)
        code = EXIT_FAILED
        out = {"state": "failed", "source": model, "error": repr(exc), "retried": True}
    if result_file is not None:
        result_file.write_text(json.dumps(out) + "\n")
    if json_lines:
        print(json.dumps({"event": "result", **out}), flush=True)
    elif code == 0:
        print(out["folder"], flush=True)
    return code


def _fetch(model: str, cache_root: Path | None, opts: FetchOptions) -> dict[str, Any]:
    source = parse(model)
    if isinstance(source, LocalSource):
        raise SourceError(f"{model} is a local folder: there is nothing to fetch")
    quiet = opts.json_lines
    say = (lambda text: None) if quiet else (lambda text: print(text, flush=True))
    sinks = [JsonLinesSink(sys.stdout)] if quiet else []
    done = fetched(source, cache_root, say, not quiet, sinks, opts.expect_revision)
    if opts.prune_keep is not None:
        protect = frozenset({done.plan.revision})
        for gone in prune(model, cache_root, opts.prune_keep, protect):
            log.info("pruned %s@%s from the cache", done.plan.source, gone.revision)
    return done.to_json()


def _transient(exc: SourceError) -> bool:
    """Worth trying again as it is: anything but a refusal of what the source holds."""
    return not isinstance(exc, (DigestMismatch, BadUri, NotAPipeline, RevisionChanged))


def plan_of(model: str, cache_root: Path | None = None) -> Plan:
    """What fetching ``model`` would move, asked of the source; nothing is downloaded
    but the pipeline's ``model_index.json`` (the hub's client caches it)."""
    source = parse(model)
    if isinstance(source, LocalSource):
        raise SourceError(f"{model} is a local folder: there is nothing to fetch")
    return store_of(source, ModelCache(cache_root or default_root())).plan()
