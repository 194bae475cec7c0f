"""Probes and metrics: open routes (no key), read-only."""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI, Response
from fastapi.responses import JSONResponse

from dpserve.router.deps import MetricsDep, PoolDep, RequestIdDep
from dpserve.router.openai_api import error_body
from dpserve.router.routes.info import control_state


async def health(pool: PoolDep, rid: RequestIdDep) -> JSONResponse:
    replicas = list(pool.replicas.values())
    silent = [pool.snapshot(r) for r in replicas if not r.answering]
    if not replicas or silent:
        message = "no replicas known" if not replicas else "some replicas do not answer"
        shown = {"status": "unhealthy", "message": message, "silent": silent}
        return JSONResponse({**error_body(503, message, None, rid), **shown}, 503)
    return JSONResponse({"status": "ok", "replicas": len(replicas)})


async def livez() -> dict[str, str]:
    """The process and its event loop are alive (replica health is /health's job)."""
    return {"status": "ok"}


async def ready(pool: PoolDep, rid: RequestIdDep) -> JSONResponse:
    serving = len(pool.serving())
    shown = {"ready": serving > 0, "serving": serving, "replicas": len(pool.replicas)}
    if not serving:
        shown = {**error_body(503, "no replica serves yet", None, rid), **shown}
    return JSONResponse(shown, 200 if serving else 503)


async def health_replicas(pool: PoolDep) -> dict[str, Any]:
    return {
        "replicas": [pool.snapshot(r) for r in pool.replicas.values()],
        "control_state": control_state(pool),
        "queue_depth": pool.admission.queue_depth,
    }


async def prometheus(pool: PoolDep, metrics: MetricsDep) -> Response:
    return Response(metrics.render(pool), media_type="text/plain; version=0.0.4")


def install(app: FastAPI) -> None:
    """Add these routes to ``app``."""
    app.get("/health")(health)
    app.get("/livez")(livez)
    app.get("/ready")(ready)
    app.get("/health/replicas")(health_replicas)
    app.get("/metrics")(prometheus)
