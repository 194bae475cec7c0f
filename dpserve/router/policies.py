"""Routing policies: small and pure, so they are tested without sockets."""

from __future__ import annotations

import hashlib
import json
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from dpserve.protocol import HTTP_STATUS, ErrorBody


class RoundRobin:
    """Cycles over replica keys; an ineligible replica is skipped, not waited for.

    The cursor is a position in the sorted key order, so replicas joining or
    leaving never make it start over at the first one.
    """

    def __init__(self) -> None:
        self._last: str | None = None

    def pick(self, keys: Iterable[str], eligible: Callable[[str], bool]) -> str | None:
        order = sorted(keys)
        if not order:
            return None
        start = 0
        if self._last is not None:
            start = next((i for i, k in enumerate(order) if k > self._last), 0)
        for i in range(len(order)):
            key = order[(start + i) % len(order)]
            if eligible(key):
                self._last = key
                return key
        return None


def hrw_order(session_id: str, keys: Iterable[str]) -> list[str]:
    """Rendezvous hashing: keys by falling hash of (session, key).

    The first is the session's owner; the rest are where it goes when the owner
    is full, in an order that adding or removing other keys never changes.
    """

    def score(key: str) -> bytes:
        return hashlib.blake2b(f"{session_id}\x00{key}".encode(), digest_size=8).digest()

    return sorted(keys, key=score, reverse=True)


def hrw_owner(session_id: str, keys: Iterable[str]) -> str | None:
    """The key with the highest hash of (session, key)."""
    order = hrw_order(session_id, keys)
    return order[0] if order else None


@dataclass(frozen=True)
class ReplicaOutcome:
    """One replica's part of a fan-out: its result or its error."""

    replica: str
    result: dict[str, Any] | None = None
    error: ErrorBody | None = None
    skipped: str | None = None  # why the replica was not asked (e.g. it is down)

    def as_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"replica": self.replica, "ok": self.error is None}
        if self.result is not None:
            out["result"] = self.result
        if self.error is not None:
            out["error"] = {"code": self.error.code, "message": self.error.message}
        if self.skipped is not None:
            out["skipped"] = self.skipped
        return out


@dataclass(frozen=True)
class FanoutAnswer:
    status: int
    body: dict[str, Any] = field(default_factory=dict)


# Fields of a read-only answer that legitimately differ between replicas.
_PER_REPLICA_FIELDS = frozenset({"replica", "ranks"})


def merge_fanout(op: str, outcomes: Sequence[ReplicaOutcome], read_only: bool) -> FanoutAnswer:
    """First error wins (its HTTP status), else success; always the per-replica list.

    Read-only answers also say whether the replicas agree, and which do not.
    """
    replicas = [o.as_dict() for o in outcomes]
    errors = [o for o in outcomes if o.error is not None]
    asked = [o for o in outcomes if o.skipped is None]
    if not asked:
        return FanoutAnswer(
            503,
            {
                "op": op,
                "success": False,
                "message": "no replica could be asked",
                "replicas": replicas,
            },
        )
    if errors:
        first = errors[0]
        assert first.error is not None
        status = HTTP_STATUS.get(first.error.code, 500)
        message = f"{first.replica}: {first.error.message}"
        return FanoutAnswer(
            status, {"op": op, "success": False, "message": message, "replicas": replicas}
        )
    body: dict[str, Any] = {"op": op, "success": True, "replicas": replicas}
    if read_only:
        # Against the majority, so one odd replica is named even when it is the first.
        keys = [_comparable(o.result) for o in asked]
        majority = Counter(keys).most_common(1)[0][0]
        differing = [o.replica for o, k in zip(asked, keys, strict=True) if k != majority]
        body["consistent"] = not differing
        body["disagreeing_replicas"] = differing
        body["result"] = asked[0].result
    return FanoutAnswer(200, body)


def _comparable(result: dict[str, Any] | None) -> str:
    kept = {k: v for k, v in (result or {}).items() if k not in _PER_REPLICA_FIELDS}
    return json.dumps(kept, sort_keys=True, default=str)
