"""Fair shares between tenants: who is served next, and whose waiter a full queue drops.

Pure policy (docs/tenants.md, "Fair shares"); :class:`~dpserve.router.admission.Admission`
owns the waiters and asks this module.

Order: start-time fair queueing over estimated cost units. Each tenant has a
virtual finish time; a request is tagged at arrival with ``start = max(clock,
tenant's finish)`` and moves the tenant's finish on by ``units / weight``. Waiters
are served by smallest start tag (then arrival), and the clock follows the tag of
each request that starts. A tenant that has sent little lately starts at the clock,
ahead of a flooder's backlog, whose tags run far past it; two backlogged tenants
advance in step, each by its cost over its weight. Nothing starves: every tag is
finite and the clock only moves forward.

The router-wide bound on waiters (``--max-waiting``) is shared the same way: when
it is full, an arrival from a tenant under its weighted share takes the place of
the newest waiter of the tenant most over its share (which gets the 429); else
the arrival is refused. A flooder fills its own share and gets its own 429s.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

# A request whose estimate is zero still takes its turn.
_MIN_UNITS = 1e-9


@dataclass(frozen=True)
class Tag:
    """A request's place in the fair order: its virtual start and finish."""

    start: float
    finish: float


@dataclass
class FairClock:
    """Each tenant's virtual finish time and the clock they start from."""

    weights: Mapping[str, int] = field(default_factory=dict)  # unnamed tenants weigh 1
    now: float = 0.0
    _finish: dict[str, float] = field(default_factory=dict)

    def weight(self, tenant: str) -> int:
        return self.weights.get(tenant, 1)

    def arrive(self, tenant: str, units: float) -> Tag:
        """Tag a request of ``tenant`` costing ``units`` and charge it to the tenant."""
        start = max(self.now, self._finish.get(tenant, 0.0))
        finish = start + max(units, _MIN_UNITS) / self.weight(tenant)
        self._finish[tenant] = finish
        return Tag(start, finish)

    def started(self, tag: Tag) -> None:
        """A request with ``tag`` took a slot: the clock catches up with it."""
        self.now = max(self.now, tag.start)

    def refund(self, tenant: str, tag: Tag) -> None:
        """A request that never ran (refused from the queue) gives its charge back when
        it was the tenant's latest."""
        if self._finish.get(tenant) == tag.finish:
            self._finish[tenant] = tag.start


def over_share(waiting: Mapping[str, int], weights: Mapping[str, int], arriving: str) -> str | None:
    """The queue is full and ``arriving`` would wait: whose waiter gives way.

    The tenant with the most waiters per unit of weight gives up its newest, if it
    would still hold more per weight than ``arriving`` does with this one; else None
    (the arrival is refused: it is the one over its share, or level with the most).
    """

    def load(tenant: str, extra: int = 0) -> float:
        return (waiting.get(tenant, 0) + extra) / weights.get(tenant, 1)

    others = [t for t, n in waiting.items() if t != arriving and n > 0]
    if not others:
        return None
    most = max(others, key=load)
    return most if load(most) > load(arriving, 1) else None


def check_weights(weights: Mapping[str, int], tenants: Iterable[str]) -> None:
    """Weights name configured tenants only (a typo would silently weigh nobody)."""
    known = set(tenants)
    unknown = sorted(set(weights) - known)
    if not unknown:
        return
    if not known:
        raise ValueError(
            f"--tenant-weight names {', '.join(unknown)}, but no API keys are configured, so "
            "every caller is one tenant: give keys (--api-key-file lines '<tenant> <key>') or "
            "drop the weights"
        )
    raise ValueError(
        f"--tenant-weight names {', '.join(unknown)}, which no key names; the tenants are "
        f"{', '.join(sorted(known))} (a key file's line '<tenant> <key>' names one)"
    )
