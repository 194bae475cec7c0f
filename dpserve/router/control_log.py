"""The ordered log of state-changing control ops that every serving replica must carry.

Each op takes a position in the log *before* it is fanned out (state
``pending``), and becomes ``done`` when at least one replica applied it or
``failed`` when none did. Replicas apply positions in order and report the last
one in their pings, so any router — a second replica of the router, or one that
restarted — knows what each replica still needs and replays exactly that. A
failed entry is replayed as a ``noop`` that only advances the position.

Where the log lives is a ``LogStore``: process memory for the embedded mode, a
ConfigMap owned by the DiffusionService in Kubernetes (``kube_log.py``).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Final, Protocol

PENDING: Final = "pending"
DONE: Final = "done"
FAILED: Final = "failed"
# A pending entry this old belongs to a router that died mid-op: some replicas
# may have applied it, so it is replayed (each replica applies a position once).
STALE_PENDING_S: Final = 600.0

Entries = list[dict[str, Any]]
Replay = tuple[int, str, dict[str, Any]]  # (position, op, args)


class LogStore(Protocol):
    def load(self) -> Entries: ...

    def update(self, change: Callable[[Entries], Entries]) -> Entries:
        """Apply ``change`` atomically (compare-and-swap); returns the stored entries."""
        ...


@dataclass
class MemoryStore:
    entries: Entries = field(default_factory=list)

    def load(self) -> Entries:
        return list(self.entries)

    def update(self, change: Callable[[Entries], Entries]) -> Entries:
        self.entries = change(list(self.entries))
        return list(self.entries)


@dataclass(frozen=True)
class LoggedOp:
    op: str
    args: dict[str, Any]
    state: str
    at: float

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> LoggedOp:
        return cls(str(raw["op"]), dict(raw.get("args") or {}), str(raw["state"]), float(raw["at"]))

    def replay_as(self, now: float) -> tuple[str, dict[str, Any]] | None:
        """What to send a replica that missed this entry; None: not yet (still pending)."""
        if self.state == FAILED:
            return "noop", {}
        if self.state == PENDING and now - self.at < STALE_PENDING_S:
            return None
        return self.op, self.args


class ControlLog:
    def __init__(self, store: LogStore | None = None) -> None:
        self.store: LogStore = store or MemoryStore()
        self.entries: list[LoggedOp] = []

    def __len__(self) -> int:
        return len(self.entries)

    def _set(self, raw: Entries) -> None:
        self.entries = [LoggedOp.from_dict(e) for e in raw]

    async def refresh(self) -> None:
        self._set(await asyncio.to_thread(self.store.load))

    async def reserve(self, op: str, args: dict[str, Any]) -> int:
        """Take the next position for ``op``; returns it (1-based)."""
        entry = {"op": op, "args": dict(args), "state": PENDING, "at": time.time()}
        position = 0

        def append(raw: Entries) -> Entries:
            nonlocal position
            position = len(raw) + 1
            return [*raw, entry]

        self._set(await asyncio.to_thread(self.store.update, append))
        return position

    async def resolve(self, position: int, applied: bool) -> None:
        state = DONE if applied else FAILED

        def mark(raw: Entries) -> Entries:
            raw[position - 1] = {**raw[position - 1], "state": state}
            return raw

        self._set(await asyncio.to_thread(self.store.update, mark))

    def since(
        self, applied: int, now: float | None = None
    ) -> list[tuple[int, str, dict[str, Any]]]:
        """(position, op, args) a replica at ``applied`` must replay, up to a live pending op."""
        now = time.time() if now is None else now
        out = []
        for position, entry in enumerate(self.entries[applied:], start=applied + 1):
            replay = entry.replay_as(now)
            if replay is None:
                break
            out.append((position, *replay))
        return out
