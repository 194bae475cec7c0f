"""The realtime WebSocket: sessions pinned to their owner replica (docs/realtime.md)."""

from __future__ import annotations

from fastapi import APIRouter, WebSocket

from dpserve.router import deps
from dpserve.router.access import inference
from dpserve.router.deps import MetricsDep, RunningDep, SettingsDep
from dpserve.router.realtime_ws import RealtimeConnection


@inference
async def realtime(
    ws: WebSocket, running: RunningDep, settings: SettingsDep, metrics: MetricsDep
) -> None:
    # Read when each init arrives: replicas say their limits and model once they serve.
    limits = lambda: deps.limits(running.pool)  # noqa: E731
    served = lambda: deps.served_name(running.pool, settings)  # noqa: E731
    counted = metrics.meter(ws.scope).frame  # each frame, for the tenant's usage
    sessions = running.sessions
    await RealtimeConnection(ws, sessions, limits, settings.realtime, served, counted).run()


def router() -> APIRouter:
    api = APIRouter()
    api.websocket("/v1/realtime_video/generate")(realtime)
    return api
