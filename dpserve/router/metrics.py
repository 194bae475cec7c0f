"""Prometheus metrics of one router, in a registry of its own (no process-global state).

Accounting: every HTTP request is counted once when it enters the app
(``dpserve_requests_accepted_total``) and once when the app is done with it
(``dpserve_requests_answered_total`` by outcome), so a request the router lost
shows as accepted > answered. ``read_accounting`` turns a scrape into the numbers.

Usage: each tenant's requests and work (dpserve/router/usage.py, one owner that
this registry collects at scrape time), and per route how long generations waited
for a slot and ran on a replica.
"""

from __future__ import annotations

import time
from collections.abc import Collection, Iterable
from dataclasses import dataclass, field
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.parser import text_string_to_metric_families
from starlette.routing import Match

from dpserve.router.lora_metrics import LoraCacheCollector
from dpserve.router.pool import ReplicaPool
from dpserve.router.replica import Replica
from dpserve.router.routes import flat
from dpserve.router.tenants import KEYLESS
from dpserve.router.usage import Usage, Work

_ROUTE_CACHE = 1024
_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
# A diffusion request waits and runs from tens of milliseconds (a few steps of a small
# image) to many minutes (a video job): roughly 2-2.5x apart up to 30 minutes.
_WORK_BUCKETS = (
    0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 20, 30, 60, 120, 300, 600, 1200, 1800,
)  # fmt: skip

# Outcomes of an HTTP request (``dpserve_requests_answered_total{outcome}``).
OK, CLIENT_ERROR, SERVER_ERROR, DISCONNECTED = "ok", "client_error", "server_error", "disconnected"
# Outcomes of a WebSocket connection (``dpserve_websockets_closed_total{outcome}``).
WS_CLOSED, WS_REFUSED, WS_ERROR = "closed", "refused", "error"


def outcome(status: int, disconnected: bool) -> str:
    """What became of a request: the client left before an answer started, or its status class.

    A client that went away gets no answer at all (the router's 499 never reaches it).
    """
    if disconnected:
        return DISCONNECTED
    if status < 400:
        return OK
    return CLIENT_ERROR if status < 500 else SERVER_ERROR


class RouterMetrics:
    def __init__(self, tenants: Iterable[str] = (KEYLESS.tenant,)) -> None:
        """``tenants``: the only values the tenant label may take (dpserve/router/usage.py)."""
        self.registry = CollectorRegistry()
        self.usage = Usage(tenants)
        self.registry.register(self.usage)
        # The replicas' adapter caches, read from the pool ``render`` is given.
        self._replicas: list[Replica] = []
        self.registry.register(LoraCacheCollector(lambda: self._replicas))
        self.queue_time = Histogram(
            "dpserve_request_queue_seconds",
            "Seconds a completed generation waited for a slot, in this router and at its "
            "replica, by route",
            ["route"],
            buckets=_WORK_BUCKETS,
            registry=self.registry,
        )
        self.inference_time = Histogram(
            "dpserve_request_inference_seconds",
            "Seconds a completed generation's pipeline ran on its replica, by route",
            ["route"],
            buckets=_WORK_BUCKETS,
            registry=self.registry,
        )
        self.requests = Counter(
            "dpserve_requests",
            "HTTP requests by route and status",
            ["route", "method", "status"],
            registry=self.registry,
        )
        self.accepted = Counter(
            "dpserve_requests_accepted",
            "HTTP requests that entered the router, counted on entry",
            ["route", "method"],
            registry=self.registry,
        )
        self.answered = Counter(
            "dpserve_requests_answered",
            "HTTP requests the router is done with, by outcome (ok, client_error, "
            "server_error, disconnected)",
            ["route", "method", "outcome"],
            registry=self.registry,
        )
        self.ws_opened = Counter(
            "dpserve_websockets_opened",
            "WebSocket connections that entered the router",
            ["route"],
            registry=self.registry,
        )
        self.ws_closed = Counter(
            "dpserve_websockets_closed",
            "WebSocket connections the router is done with, by outcome (closed, refused, error)",
            ["route", "outcome"],
            registry=self.registry,
        )
        self.latency = Histogram(
            "dpserve_request_duration_seconds",
            "HTTP request latency by route and status",
            ["route", "method", "status"],
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.replica_inflight = Gauge(
            "dpserve_replica_in_flight",
            "Requests in flight per replica",
            ["replica"],
            registry=self.registry,
        )
        self.replica_healthy = Gauge(
            "dpserve_replica_serving",
            "1 when the replica takes traffic",
            ["replica"],
            registry=self.registry,
        )
        self.replica_sessions = Gauge(
            "dpserve_replica_realtime_sessions",
            "Realtime sessions each replica holds (as of its last ping)",
            ["replica"],
            registry=self.registry,
        )
        self.queue_depth = Gauge(
            "dpserve_queue_depth", "Requests waiting for a replica slot", registry=self.registry
        )
        # Autoscaling signals (docs/autoscaling.md): load as the replicas report it.
        self.replica_queue_depth = Gauge(
            "dpserve_replica_queue_depth",
            "Requests queued at each replica, from every router (as of its last ping)",
            ["replica"],
            registry=self.registry,
        )
        self.replica_work = Gauge(
            "dpserve_replica_outstanding_work_seconds",
            "Estimated seconds of work queued and running at each replica, from every router",
            ["replica"],
            registry=self.registry,
        )
        self.replica_busy = Gauge(
            "dpserve_replica_busy_fraction",
            "Share of each replica's recent window (20 s) spent working, 0..1 (last ping)",
            ["replica"],
            registry=self.registry,
        )
        self.work = Gauge(
            "dpserve_outstanding_work_seconds",
            "Estimated seconds of work queued and running, summed over the replicas",
            registry=self.registry,
        )
        # Read at scrape time from the running app's video jobs (app.py's lifespan).
        self.video_jobs = Gauge(
            "dpserve_video_jobs_watched",
            "Video jobs this router placed and watches until they finish",
            registry=self.registry,
        )
        self.webhook_events = Counter(
            "dpserve_webhook_events",
            "Webhook events (docs/webhooks.md) by type and how they ended: delivered, "
            "dropped (the queue was full) or given_up (no 2xx within --webhook-retry-for)",
            ["type", "outcome"],
            registry=self.registry,
        )
        # Read at scrape time from the running app's webhook queue (app.py's lifespan).
        self.webhook_waiting = Gauge(
            "dpserve_webhook_events_waiting",
            "Webhook events queued for a sender (not those being sent or retried)",
            registry=self.registry,
        )

    def observe(
        self, route: str, method: str, status: int, seconds: float, disconnected: bool = False
    ) -> None:
        labels = (route, method, str(status))
        self.requests.labels(*labels).inc()
        self.latency.labels(*labels).observe(seconds)
        self.answered.labels(route, method, outcome(status, disconnected)).inc()

    def meter(self, scope: Any) -> Meter:
        """Where the work of the request of ``scope`` is counted (called by its handler,
        once routing has picked the route)."""
        route = str(getattr(scope.get("route"), "path", "unmatched"))
        return Meter(self, self.usage.tenant_of(scope), route)

    def render(self, pool: ReplicaPool) -> bytes:
        """Gauges are read from the pool at scrape time, so they are never stale."""
        per_replica = (
            self.replica_inflight,
            self.replica_healthy,
            self.replica_sessions,
            self.replica_queue_depth,
            self.replica_work,
            self.replica_busy,
        )
        for gauge in per_replica:
            gauge.clear()
        total = 0.0
        self._replicas = list(pool.replicas.values())
        for replica in pool.replicas.values():
            work = pool.load.outstanding_s(replica)
            total += work
            self.replica_sessions.labels(replica.endpoint).set(replica.sessions)
            self.replica_inflight.labels(replica.endpoint).set(replica.inflight)
            self.replica_healthy.labels(replica.endpoint).set(1 if replica.serving else 0)
            self.replica_queue_depth.labels(replica.endpoint).set(replica.queue_depth)
            self.replica_work.labels(replica.endpoint).set(work)
            self.replica_busy.labels(replica.endpoint).set(replica.busy_fraction)
        self.queue_depth.set(pool.admission.queue_depth)
        self.work.set(total)
        return generate_latest(self.registry)


@dataclass(frozen=True)
class Meter:
    """Counts what one request made: for its tenant (if a configured one), and in its
    route's queue and inference histograms."""

    metrics: RouterMetrics
    tenant: str | None
    route: str

    def __call__(self, work: Work) -> None:
        self.metrics.usage.made(self.tenant, work)
        self.metrics.queue_time.labels(self.route).observe(work.queue_s)
        self.metrics.inference_time.labels(self.route).observe(work.inference_s)

    def frame(self, inference_s: float) -> None:
        """A realtime session's frame: it waits in no queue (its session holds the
        replica), so only its pipeline time is observed."""
        self.metrics.usage.made(self.tenant, Work(realtime_frames=1, inference_s=inference_s))
        self.metrics.inference_time.labels(self.route).observe(inference_s)


def _route_of(scope: Any) -> str:
    """The route template the app will pick for ``scope``, known before it runs.

    The router's own choice, replayed: the first full match, else the first
    partial one (a wrong method, answered 405).
    """
    partial = None
    for route in flat(getattr(getattr(scope.get("app"), "router", None), "routes", ())):
        match, _ = route.matches(scope)
        if match == Match.FULL:
            return str(getattr(route, "path", "unmatched"))
        if match == Match.PARTIAL and partial is None:
            partial = str(getattr(route, "path", "unmatched"))
    return partial or "unmatched"


class MetricsMiddleware:
    """Pure ASGI (not BaseHTTPMiddleware, which hides client disconnects from routes)."""

    def __init__(self, app: Any, metrics: RouterMetrics) -> None:
        self.app = app
        self.metrics = metrics
        # Route labels by what routing reads: matching costs microseconds per route.
        # Bounded, since clients choose the paths; past the bound, labels are computed.
        self._routes: dict[tuple[str, str, str, str], str] = {}

    def _route(self, scope: Any) -> str:
        key = (scope["type"], scope.get("method", ""), scope.get("root_path", ""), scope["path"])
        route = self._routes.get(key)
        if route is None:
            route = _route_of(scope)
            if len(self._routes) < _ROUTE_CACHE:
                self._routes[key] = route
        return route

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "websocket":
            await self._websocket(scope, receive, send)
            return
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        route, method = self._route(scope), scope["method"]
        self.metrics.accepted.labels(route, method).inc()
        # Without a response start the app raised, and the server answers 500.
        started, status, responded, disconnected = time.perf_counter(), 500, False, False

        async def receive_and_note() -> Any:
            nonlocal disconnected
            message = await receive()
            if message["type"] == "http.disconnect" and not responded:
                disconnected = True
            return message

        async def send_and_record(message: Any) -> None:
            nonlocal status, responded
            if message["type"] == "http.response.start":
                status, responded = message["status"], True
            await send(message)

        try:
            await self.app(scope, receive_and_note, send_and_record)
        finally:
            elapsed = time.perf_counter() - started
            self.metrics.observe(route, method, status, elapsed, disconnected)
            # The auth middleware inside put the principal in this very scope.
            tenant = self.metrics.usage.tenant_of(scope)
            self.metrics.usage.answered(tenant, route, outcome(status, disconnected))

    async def _websocket(self, scope: Any, receive: Any, send: Any) -> None:
        route = self._route(scope)
        self.metrics.ws_opened.labels(route).inc()
        accepted, result = False, WS_ERROR

        async def send_and_note(message: Any) -> None:
            nonlocal accepted
            if message["type"] == "websocket.accept":
                accepted = True
            await send(message)

        try:
            await self.app(scope, receive, send_and_note)
            result = WS_CLOSED if accepted else WS_REFUSED
        finally:
            self.metrics.ws_closed.labels(route, result).inc()


@dataclass(frozen=True)
class Accounting:
    """What a ``/metrics`` scrape says about requests in and answers out."""

    accepted: int
    answered: dict[str, int]  # by outcome
    websockets_opened: int = 0
    websockets_closed: dict[str, int] = field(default_factory=dict)  # by outcome

    @property
    def unanswered(self) -> int:
        """Requests in flight at the scrape, or lost: 0 once the clients are done."""
        return self.accepted - sum(self.answered.values())

    @property
    def websockets_open(self) -> int:
        return self.websockets_opened - sum(self.websockets_closed.values())


def read_accounting(text: str, skip_routes: Collection[str] = ("/metrics",)) -> Accounting:
    """Parse a ``/metrics`` scrape into an ``Accounting``.

    ``/metrics`` itself is left out by default: the scrape that wrote ``text`` was
    accepted but not yet answered while it rendered.
    """
    accepted = opened = 0
    answered: dict[str, int] = {}
    closed: dict[str, int] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if not sample.name.endswith("_total") or sample.labels.get("route") in skip_routes:
                continue
            value = int(sample.value)
            if family.name == "dpserve_requests_accepted":
                accepted += value
            elif family.name == "dpserve_requests_answered":
                key = sample.labels["outcome"]
                answered[key] = answered.get(key, 0) + value
            elif family.name == "dpserve_websockets_opened":
                opened += value
            elif family.name == "dpserve_websockets_closed":
                key = sample.labels["outcome"]
                closed[key] = closed.get(key, 0) + value
    return Accounting(accepted, answered, opened, closed)
