"""Routing policies: small and pure, so they are tested without sockets."""

from __future__ import annotations

import hashlib
import json
import statistics
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Final, NamedTuple, Protocol, get_args

from dpserve.config.router import PolicyName
from dpserve.config.router import default as router_default
from dpserve.contract.protocol import (
    HTTP_STATUS,
    UNAVAILABLE,
    ErrorBody,
)

POLICIES: Final[tuple[PolicyName, ...]] = get_args(PolicyName)
# Seconds per cost unit while no replica has measured one: costs are then compared
# in plain units (the ranking is what matters; the seconds shown are units).
UNCALIBRATED_SECONDS_PER_UNIT: Final = 1.0
# Requests deeper than the best replica a request's adapters' home may be and still
# take it (``--adapter-home-slack``; docs/lora.md).
HOME_SLACK: Final[float] = router_default("adapter_home_slack")


class Estimate(NamedTuple):
    """A request at one replica, in seconds: the work ahead of it there, its own, and
    loading the LoRA adapters it names that the replica lacks (docs/lora.md)."""

    wait_s: float
    own_s: float
    load_s: float = 0.0

    @property
    def finish_s(self) -> float:
        return self.wait_s + self.load_s + self.own_s


class Policy(Protocol):
    def pick(
        self,
        keys: Iterable[str],
        eligible: Callable[[str], bool],
        estimate: Callable[[str], Estimate] | None = None,
        affinity: str | None = None,
        home: str | None = None,
    ) -> str | None:
        """An eligible key, or None; ``estimate``: the request's wait and own cost there;
        ``affinity``: its adapters' key, where it names adapters and routing minds them;
        ``home``: where the fleet's placement puts those adapters (adapter_homes.py)."""
        ...


class RoundRobin:
    """Cycles over replica keys; an ineligible replica is skipped, not waited for.

    The cursor is a position in the sorted key order, so replicas joining or
    leaving never make it start over at the first one.
    """

    def __init__(self) -> None:
        self._last: str | None = None

    def pick(
        self,
        keys: Iterable[str],
        eligible: Callable[[str], bool],
        estimate: Callable[[str], Estimate] | None = None,  # not read: cost-blind
        affinity: str | None = None,  # nor these
        home: str | None = None,
    ) -> str | None:
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


class LeastWork:
    """The eligible replica where the request is estimated to finish first: its
    outstanding work plus the request's own cost there (``estimate``).

    **Decision:** replicas with no work ahead that hold the request's adapters (all
    of them, for a request without its own) take turns, as round-robin does,
    whatever their calibrations say: one service's replicas share model and layout,
    their measured figures differ by noise (a loaded host, a first request at a new
    size), and sequential traffic must not pile onto whichever measured faster while
    the other idles and never gets the traffic that would correct its figure. When
    none is idle and ready, the finish times decide, adapter loads included: an idle
    holder beats an idle replica that must load, and a holder buried in work loses to
    an idle one that loads, so one adapter's requests gather without piling up. Those
    within ``tie_frac`` of the best's own cost (its load included) take turns; one
    with more ahead is passed over. For a request with adapters (``affinity``), its
    adapters' ``home`` (the fleet's placement by demand, adapter_homes.py) takes it
    when it finishes there within ``home_frac`` requests of the best
    (``--adapter-home-slack``): a detour that size saves the loads and evictions of
    spreading hot adapters over every cache, and costs the latency of the deeper
    queue (docs/lora.md, What it costs). Else the holders among those within the tie take
    turns, and where none holds them, a rendezvous hash of ``affinity`` picks one:
    the same replica from every router.

    **Decision** (docs/router.md, "Routing policies"): only replicas with a free
    slot are eligible, so a request never waits in the router while a replica could
    start it. Waiting for a better but full replica would help a little when every
    waiter's choice counted the others' (a central schedule), and hurts when they
    do not: they all wait for the same replica while another idles.
    """

    def __init__(
        self, tie_frac: float = 0.25, tie_s: float = 1e-3, home_frac: float = HOME_SLACK
    ) -> None:
        self.tie_frac, self.tie_s, self.home_frac = tie_frac, tie_s, home_frac
        self._turns = RoundRobin()

    def pick(
        self,
        keys: Iterable[str],
        eligible: Callable[[str], bool],
        estimate: Callable[[str], Estimate] | None = None,
        affinity: str | None = None,
        home: str | None = None,
    ) -> str | None:
        candidates = [k for k in keys if eligible(k)]
        if not candidates or estimate is None:
            return self._turns.pick(candidates, lambda k: True)
        estimates = {k: estimate(k) for k in candidates}
        ready = {k for k, e in estimates.items() if max(e.wait_s, e.load_s) <= self.tie_s}
        if ready:
            return self._turns.pick(candidates, lambda k: k in ready)
        best = min(estimates.values(), key=lambda e: e.finish_s)
        if affinity is not None and home in estimates:
            slack = self.home_frac * best.own_s
            if estimates[home].finish_s <= best.finish_s + slack:
                return home
        bound = best.finish_s + max(self.tie_s, self.tie_frac * (best.own_s + best.load_s))
        near = [k for k in candidates if estimates[k].finish_s <= bound]
        if affinity is not None:
            # Within the tie, adapters gather: holders take turns; where none holds
            # them, their home loads them, the same replica for every router.
            fewest = min(estimates[k].load_s for k in near)
            if fewest > self.tie_s:
                return hrw_order(affinity, near)[0]
            near = [k for k in near if estimates[k].load_s <= self.tie_s]
        return self._turns.pick(candidates, lambda k: k in near)


def make_policy(name: PolicyName, home_slack: float = HOME_SLACK) -> Policy:
    """``home_slack``: least work's ``home_frac`` (``--adapter-home-slack``)."""
    if name == "round_robin":
        return RoundRobin()
    if name == "least_work":
        return LeastWork(home_frac=home_slack)
    raise ValueError(f"unknown routing policy {name!r}; expected one of {', '.join(POLICIES)}")


class WorkLedger:
    """This router's requests at one replica: each one's cost units and estimated
    seconds, in the order sent.

    A replica runs its queue in order, so the oldest is the one running: its
    estimate shrinks by the time since it started (when it was sent, or when the
    one before it was answered), down to zero when it overruns. Work other routers
    placed there is not in here (the pool adds what the replica's pings say).
    """

    def __init__(self) -> None:
        self._jobs: dict[int, tuple[float, float]] = {}  # ticket -> (units, seconds)
        self._started = 0.0  # when the oldest began, as far as this router can tell

    def __len__(self) -> int:
        return len(self._jobs)

    def add(self, ticket: int, units: float, seconds: float, now: float) -> None:
        if not self._jobs:
            self._started = now
        self._jobs[ticket] = (units, seconds)

    def remove(self, ticket: int, now: float) -> None:
        oldest = next(iter(self._jobs), None)
        self._jobs.pop(ticket, None)
        if ticket == oldest:
            self._started = now  # the next one starts now

    @property
    def units(self) -> float:
        return sum(units for units, _ in self._jobs.values())

    def seconds(self, now: float) -> float:
        """Estimated seconds of this router's work left there."""
        if not self._jobs:
            return 0.0
        total = sum(seconds for _, seconds in self._jobs.values())
        head = next(iter(self._jobs.values()))[1]
        return total - min(head, max(0.0, now - self._started))


def seconds_per_unit(own: float | None, others: Iterable[float | None]) -> float:
    """A replica's measured seconds per unit; until it has one, the median of the
    other replicas' (same model, likely the same hardware); else plain units."""
    measured = measured_seconds_per_unit(own, others)
    return UNCALIBRATED_SECONDS_PER_UNIT if measured is None else measured


def measured_seconds_per_unit(own: float | None, others: Iterable[float | None]) -> float | None:
    """:func:`seconds_per_unit` where some replica has measured one; None before."""
    if own is not None:
        return own
    known = [s for s in others if s is not None]
    return statistics.median(known) if known else None


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
    code: str | None = None  # a failed one's: the first error's wire code


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
            UNAVAILABLE,
        )
    if errors:
        first = errors[0]
        assert first.error is not None
        status = HTTP_STATUS.get(first.error.code, 500)
        message = f"{first.replica}: {first.error.message}"
        return FanoutAnswer(
            status,
            {"op": op, "success": False, "message": message, "replicas": replicas},
            first.error.code,
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
