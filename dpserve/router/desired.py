"""The control state this router wants every replica to hold, and where it is kept.

:class:`DesiredState` owns the desired document, for the control plane
(dpserve/router/control_plane.py), which owns the rest of the router's control
state. It adopts the greatest document
(dpserve.contract.control_state) it sees — in its store, or reported by a replica in a
ping — so a restarted router, a second router, or a router whose ConfigMap was
deleted picks up the state the service really has instead of starting over.
Writes go through the store's compare-and-swap ``advance``, which only ever
moves the stored document forward, and only to a document made knowing the stored
one (``stored_after``): an op built on a stale state loses to the stored one, and
its router builds it again on top (dpserve/router/control_plane.py).

Where the document lives is a ``StateStore``: process memory for the embedded
mode (the replicas' own reports are what a restarted router recovers from),
a ConfigMap owned by the DiffusionService in Kubernetes (``kubernetes.py``).
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field
from typing import Protocol

from dpserve.contract.control_state import StateDoc, newest, stored_after

log = logging.getLogger(__name__)

OutOfSync = dict[str, str]  # replica endpoint -> why it does not hold the desired state


class StateStore(Protocol):
    def load(self) -> StateDoc | None: ...

    def advance(self, doc: StateDoc) -> StateDoc:
        """Store ``doc`` if it knows what is stored (``stored_after``); returns what is
        stored after."""
        ...

    def report(self, out_of_sync: OutOfSync, known: set[str]) -> None:
        """Publish which of the ``known`` replicas are out of sync (and why)."""
        ...


@dataclass
class MemoryStore:
    doc: StateDoc | None = None
    out_of_sync: OutOfSync = field(default_factory=dict)

    def load(self) -> StateDoc | None:
        return self.doc

    def advance(self, doc: StateDoc) -> StateDoc:
        self.doc = stored_after(self.doc, doc)
        return self.doc

    def report(self, out_of_sync: OutOfSync, known: set[str]) -> None:
        self.out_of_sync = dict(out_of_sync)


class DesiredState:
    def __init__(self, store: StateStore | None = None) -> None:
        self.store: StateStore = store or MemoryStore()
        self.doc: StateDoc | None = None  # unknown until the store or a replica says
        self._reported: OutOfSync | None = None

    def observe(self, held: StateDoc | None) -> bool:
        """A replica's document; True when it is newer and became the desired one."""
        if held is None or (self.doc is not None and held.key <= self.doc.key):
            return False
        if self.doc is not None:
            log.info("adopting control state version %d (%s)", held.version, held.op or "boot")
        self.doc = held
        return True

    async def refresh(self) -> None:
        """Adopt a newer stored document; store ours when it is the newer one."""
        stored = await asyncio.to_thread(self.store.load)
        if self.doc is not None and (stored is None or self.doc.key > stored.key):
            stored = await asyncio.to_thread(self.store.advance, self.doc)
        self.doc = newest(self.doc, stored)

    async def commit(self, doc: StateDoc) -> StateDoc:
        """Make ``doc`` the desired state; returns the stored one: another router's,
        which becomes the desired one instead, when ``doc`` did not know it."""
        stored = await asyncio.to_thread(self.store.advance, doc)
        self.doc = newest(self.doc, stored)
        return stored

    async def report(self, out_of_sync: OutOfSync, known: set[str]) -> None:
        """Publish out-of-sync replicas when the set (or a reason) changed."""
        if out_of_sync == self._reported:
            return
        await asyncio.to_thread(self.store.report, out_of_sync, known)
        self._reported = dict(out_of_sync)
