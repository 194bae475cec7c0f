"""The ordered log of state-changing control ops that every serving replica must carry.

A replica that joins, comes back, or missed an op is replayed the entries it has
not applied before it takes traffic, so every serving replica has the same
weights and adapters. The log lives in memory here; the operator issue moves it
where every router replica sees it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class LoggedOp:
    op: str
    args: dict[str, Any]


@dataclass
class ControlLog:
    entries: list[LoggedOp] = field(default_factory=list)

    def append(self, op: str, args: dict[str, Any]) -> int:
        """Record an op; returns its position (replicas at or past it have applied it)."""
        self.entries.append(LoggedOp(op, dict(args)))
        return len(self.entries)

    def since(self, applied: int) -> list[tuple[int, LoggedOp]]:
        """Entries a replica that applied the first ``applied`` ones still needs."""
        return [(i + 1, e) for i, e in enumerate(self.entries[applied:], start=applied)]

    def __len__(self) -> int:
        return len(self.entries)
