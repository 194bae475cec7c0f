"""``--model`` to a local pipeline folder: a local folder as it is; a hub repository or a
bucket prefix planned (the total said before any byte moves), then fetched into the
model cache once, verified, and published (``cache.ModelCache``)."""

from __future__ import annotations

import json
import logging
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Protocol

from dpserve.sources.cache import Entry, ModelCache, default_root
from dpserve.sources.errors import SourceError
from dpserve.sources.plan import Plan
from dpserve.sources.progress import Meter, default_sinks
from dpserve.sources.uri import HubSource, LocalSource, S3Source, Source, parse

log = logging.getLogger("dpserve.sources")


class Store(Protocol):
    name: str  # the source's folder in the cache
    draws_own_bars: bool  # the hub's client shows its own (huggingface_hub's tqdm)

    def plan(self) -> Plan: ...

    def fill(self, plan: Plan, staging: Path, meter: Meter) -> Path: ...


def store_of(source: HubSource | S3Source, cache: ModelCache) -> Store:
    if isinstance(source, S3Source):
        from dpserve.sources.s3 import S3Store

        return S3Store(source)
    from dpserve.sources.hub import HubStore

    return HubStore(source, cache.root / "hf")


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
    cache = ModelCache(cache_root or default_root())
    store = store_of(source, cache)
    if isinstance(source, HubSource) and is_commit(source.revision):
        # Pinned to a commit (as every replica of a rolled-out revision is): a ready
        # entry needs no hub, so replicas start while the hub is down or offline.
        ready = cache.ready(Entry(cache.root, store.name, source.revision))
        if ready is not None:
            return ready
    return fetch_into(store, cache, say, bar)


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
    entry = cache.entry(store.name, plan)
    return cache.fill(entry, plan, lambda p, staging: _fill(store, entry, p, staging, bar))


def _fill(store: Store, entry: Entry, plan: Plan, staging: Path, bar: bool) -> Path:
    sinks = default_sinks(log, entry.progress, bar and not store.draws_own_bars)
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
    """Remove ``model``'s cache entries beyond the ``keep`` newest, never a revision in
    ``protect`` (the one replicas load), for a roll to call once it is done; a hub
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


def fetch_main(model: str, cache_root: Path | None, dry_run: bool = False) -> int:
    """``dpserve fetch``: the plan first, progress on stderr, the folder last on stdout;
    with ``dry_run``, only the plan, as JSON (what a fill would move)."""
    try:
        if dry_run:
            print(json.dumps(plan_of(model, cache_root).to_json(), indent=1), flush=True)
            return 0
        folder = local_folder(model, cache_root, say=lambda text: print(text, flush=True))
    except SourceError as exc:
        print(f"dpserve fetch: {exc}", file=sys.stderr)
        return 1
    print(folder, flush=True)
    return 0


def plan_of(model: str, cache_root: Path | None = None) -> Plan:
    """What fetching ``model`` would move, asked of the source; nothing is downloaded
    but the pipeline's ``model_index.json`` (the hub's client caches it)."""
    source = parse(model)
    if isinstance(source, LocalSource):
        raise SourceError(f"{model} is a local folder: there is nothing to fetch")
    return store_of(source, ModelCache(cache_root or default_root())).plan()
