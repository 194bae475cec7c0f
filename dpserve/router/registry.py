"""The generation requests this router serves, by request id, and those it recently finished.

One owner (the app's lifespan makes one per router): handlers register a request
with the task serving it, the service reports its stage, and a cancel by id finds
it here. Finished ids are kept a while (bounded in count and age) so a cancel that
comes too late is told so (409) rather than "unknown" (404). Each id is kept with its
tenant: another tenant's request is unknown to a caller (dpserve/contract/owners.py).
"""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Final

from dpserve.contract import protocol as p
from dpserve.contract.owners import may_see

# Where a request is. The replica-side pair comes from a replica's CancelResult
# (a request another router admitted); this router's own are the first two.
QUEUED_IN_ROUTER: Final = "queued_in_router"
AT_REPLICA: Final = "at_replica"  # queued at or running on a replica
QUEUED_AT_REPLICA: Final = "queued_at_replica"
RUNNING_AT_REPLICA: Final = "running_at_replica"

COMPLETED, FAILED, CANCELLED = "completed", "failed", "cancelled"

RECENT_MAX: Final = 4096
RECENT_TTL_S: Final = 600.0


@dataclass
class InFlight:
    request_id: str
    tenant: str = ""  # whose request it is
    stage: str = QUEUED_IN_ROUTER
    task: asyncio.Future[Any] | None = None
    cancelled: bool = False  # by a cancel call (not by the client leaving)

    def at_replica(self) -> None:
        self.stage = AT_REPLICA

    def queued(self) -> None:
        self.stage = QUEUED_IN_ROUTER


@dataclass
class Registry:
    recent_max: int = RECENT_MAX
    recent_ttl_s: float = RECENT_TTL_S
    clock: Callable[[], float] = time.monotonic
    _live: dict[str, InFlight] = field(default_factory=dict)
    _recent: OrderedDict[str, tuple[str, float, str]] = field(default_factory=OrderedDict)

    def __len__(self) -> int:
        return len(self._live)

    def admit(self, request_id: str, tenant: str = "") -> InFlight:
        """A new request; an id already in flight here is a 409 (ids name one request)."""
        if request_id in self._live:
            raise p.RequestError(
                p.CONFLICT,
                f"request id {request_id!r} is already in flight on this router; "
                "send a new X-Request-Id (or none: one is made)",
            )
        entry = InFlight(request_id, tenant)
        self._live[request_id] = entry
        return entry

    def get(self, request_id: str) -> InFlight | None:
        return self._live.get(request_id)

    def finish(self, entry: InFlight, outcome: str) -> None:
        if self._live.get(entry.request_id) is entry:
            del self._live[entry.request_id]
        self._recent[entry.request_id] = (outcome, self.clock(), entry.tenant)
        self._recent.move_to_end(entry.request_id)
        self._trim()

    def finished(self, request_id: str, scope: str | None = None) -> str | None:
        """How a recently finished request of ``scope``'s ended (COMPLETED, FAILED,
        CANCELLED), if known."""
        self._trim()
        seen = self._recent.get(request_id)
        return seen[0] if seen is not None and may_see(scope, seen[2]) else None

    def cancel(self, request_id: str, scope: str | None = None) -> InFlight | None:
        """Cancel a request this router serves, wherever it is; None if it serves none.

        Cancelling its task takes it out of the pool's wait, or (at a replica) makes
        the service send the replica a cancel: the replica drops it at its next
        denoising step and the slot frees when it answers. Another tenant's (not
        ``scope``'s) is left alone: None, as for an unknown id.
        """
        entry = self._live.get(request_id)
        if entry is None or not may_see(scope, entry.tenant):
            return None
        entry.cancelled = True
        if entry.task is not None:
            entry.task.cancel()
        return entry

    def _trim(self) -> None:
        oldest = self.clock() - self.recent_ttl_s
        while self._recent and (
            len(self._recent) > self.recent_max or next(iter(self._recent.values()))[1] < oldest
        ):
            self._recent.popitem(last=False)
