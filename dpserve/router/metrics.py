"""Prometheus metrics of one router, in a registry of its own (no process-global state)."""

from __future__ import annotations

import time
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from dpserve.router.pool import ReplicaPool

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)


class RouterMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter(
            "dpserve_requests",
            "HTTP requests by route and status",
            ["route", "method", "status"],
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

    def observe(self, route: str, method: str, status: int, seconds: float) -> None:
        labels = (route, method, str(status))
        self.requests.labels(*labels).inc()
        self.latency.labels(*labels).observe(seconds)

    def render(self, pool: ReplicaPool) -> bytes:
        """Gauges are read from the pool at scrape time, so they are never stale."""
        self.replica_inflight.clear()
        self.replica_healthy.clear()
        self.replica_sessions.clear()
        for replica in pool.replicas.values():
            self.replica_sessions.labels(replica.endpoint).set(replica.sessions)
            self.replica_inflight.labels(replica.endpoint).set(replica.inflight)
            self.replica_healthy.labels(replica.endpoint).set(1 if replica.serving else 0)
        self.queue_depth.set(pool.queue_depth)
        return generate_latest(self.registry)


class MetricsMiddleware:
    """Pure ASGI (not BaseHTTPMiddleware, which hides client disconnects from routes)."""

    def __init__(self, app: Any, metrics: RouterMetrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started, status = time.perf_counter(), 500

        async def send_and_record(message: Any) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_and_record)
        finally:
            # The router stores the matched route in the (shared) scope.
            path = getattr(scope.get("route"), "path", "unmatched")
            self.metrics.observe(path, scope["method"], status, time.perf_counter() - started)
