"""Each tenant's use of the service since the router started (docs/tenants.md, Usage).

:class:`Usage` is the one owner of the counts: ``/metrics`` reads it at scrape time
(it is a Prometheus collector) and ``GET /v1/usage`` shows the same totals as JSON,
so the two can never disagree. Its tenants are fixed when the app is built (the
configured ones, or "default" without keys): a request counts only for a tenant
the keys named, so nothing a client sends can add a label value, and the series
stay bounded. What a request made is counted when its work is done: an image
request's images when it is answered, a video job's frames when the router that
placed it sees it completed.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

from prometheus_client.core import CounterMetricFamily, Metric

from dpserve.router.tenants import SCOPE_KEY, principal_of


@dataclass(frozen=True)
class Work:
    """What one request made, as its replica reported it; ``units`` is the router's
    estimate of its cost (dpserve/contract/cost.py), ``inference_s`` the replica's
    pipeline time (one gang's wall time), ``queue_s`` its wait for a slot in the
    router and in the replica's queue."""

    images: int = 0
    frames: int = 0
    units: float = 0.0
    inference_s: float = 0.0
    queue_s: float = 0.0
    realtime_frames: int = 0


@dataclass
class TenantTotals:
    requests: dict[tuple[str, str], int] = field(default_factory=dict)  # (route, outcome)
    images: int = 0
    video_frames: int = 0
    realtime_frames: int = 0
    cost_units: float = 0.0
    inference_seconds: float = 0.0

    def add(self, work: Work) -> None:
        self.images += work.images
        self.video_frames += work.frames
        self.realtime_frames += work.realtime_frames
        self.cost_units += work.units
        self.inference_seconds += work.inference_s

    def by_outcome(self) -> dict[str, int]:
        counted: dict[str, int] = {}
        for (_, outcome), n in self.requests.items():
            counted[outcome] = counted.get(outcome, 0) + n
        return counted

    def shown(self, tenant: str) -> dict[str, Any]:
        by_route: dict[str, dict[str, int]] = {}
        for (route, outcome), n in sorted(self.requests.items()):
            by_route.setdefault(route, {})[outcome] = n
        return {
            "tenant": tenant,
            "requests": self.by_outcome(),
            "requests_by_route": by_route,
            "images": self.images,
            "video_frames": self.video_frames,
            "realtime_frames": self.realtime_frames,
            "cost_units": self.cost_units,
            "inference_seconds": self.inference_seconds,
        }


class Usage:
    """Per-tenant totals: requests by route and outcome, images, video frames, realtime
    frames, cost units and inference seconds. A Prometheus collector over those totals."""

    def __init__(self, tenants: Iterable[str]) -> None:
        self._totals = {tenant: TenantTotals() for tenant in sorted(set(tenants))}

    @property
    def tenants(self) -> tuple[str, ...]:
        return tuple(self._totals)

    def tenant_of(self, scope: Any) -> str | None:
        """The configured tenant a request acts for; None for one the auth middleware
        refused (no principal in its scope) or let through without a key."""
        if SCOPE_KEY not in scope:
            return None
        tenant = principal_of(scope).tenant
        return tenant if tenant in self._totals else None

    def answered(self, tenant: str | None, route: str, outcome: str) -> None:
        totals = self._totals.get(tenant) if tenant is not None else None
        if totals is not None:
            key = (route, outcome)
            totals.requests[key] = totals.requests.get(key, 0) + 1

    def made(self, tenant: str | None, work: Work) -> None:
        totals = self._totals.get(tenant) if tenant is not None else None
        if totals is not None:
            totals.add(work)

    def totals(self, tenant: str) -> TenantTotals:
        return self._totals[tenant]

    def report(self) -> list[dict[str, Any]]:
        """Every tenant's totals, as ``GET /v1/usage`` shows them."""
        return [totals.shown(tenant) for tenant, totals in self._totals.items()]

    def collect(self) -> Iterator[Metric]:
        """The totals as counters, read at scrape time (every tenant, zeros included)."""
        requests = CounterMetricFamily(
            "dpserve_tenant_requests",
            "HTTP requests each tenant sent, by route and outcome (as dpserve_requests_answered)",
            labels=["tenant", "route", "outcome"],
        )
        images = CounterMetricFamily(
            "dpserve_tenant_images", "Images made for each tenant", labels=["tenant"]
        )
        frames = CounterMetricFamily(
            "dpserve_tenant_video_frames",
            "Video frames made for each tenant (jobs this router placed, once completed)",
            labels=["tenant"],
        )
        realtime = CounterMetricFamily(
            "dpserve_tenant_realtime_frames",
            "Frames of realtime sessions streamed to each tenant",
            labels=["tenant"],
        )
        units = CounterMetricFamily(
            "dpserve_tenant_cost_units",
            "Estimated cost units of each tenant's completed work (the routing cost model)",
            labels=["tenant"],
        )
        seconds = CounterMetricFamily(
            "dpserve_tenant_inference_seconds",
            "Seconds the replicas' pipelines ran for each tenant (times GPUs per replica: "
            "GPU-seconds)",
            labels=["tenant"],
        )
        for tenant, totals in self._totals.items():
            for (route, outcome), n in totals.requests.items():
                requests.add_metric([tenant, route, outcome], n)
            images.add_metric([tenant], totals.images)
            frames.add_metric([tenant], totals.video_frames)
            realtime.add_metric([tenant], totals.realtime_frames)
            units.add_metric([tenant], totals.cost_units)
            seconds.add_metric([tenant], totals.inference_seconds)
        yield from (requests, images, frames, realtime, units, seconds)
