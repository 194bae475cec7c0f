"""Probes and metrics, read-only. Open (no key): a kubelet's ``httpGet`` probe takes
no header from a Secret, and a Prometheus scrape then needs no Secret either;
``/metrics`` carries counts and the replicas' pod addresses, which anyone who can list
Endpoints sees anyway (docs/router.md, Security). ``/health/replicas`` needs an admin
key: it shows the control state (LoRA and weight paths) and each replica's endpoint
and errors."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Response
from fastapi.responses import JSONResponse

from dpserve.router.access import admin, public
from dpserve.router.deps import MetricsDep, PoolDep, RequestIdDep
from dpserve.router.openai_api import error_body
from dpserve.router.routes.info import control_state


@public
async def health(pool: PoolDep, rid: RequestIdDep) -> JSONResponse:
    """Open, so it names the silent replicas and no more: their errors and state are
    /health/replicas' (an admin's)."""
    replicas = list(pool.replicas.values())
    silent = [{"replica": r.name, "endpoint": r.endpoint} for r in replicas if not r.answering]
    if not replicas or silent:
        message = "no replicas known" if not replicas else "some replicas do not answer"
        shown = {"status": "unhealthy", "message": message, "silent": silent}
        return JSONResponse({**error_body(503, message, None, rid), **shown}, 503)
    return JSONResponse({"status": "ok", "replicas": len(replicas)})


@public
async def livez() -> dict[str, str]:
    """The process and its event loop are alive (replica health is /health's job)."""
    return {"status": "ok"}


@public
async def ready(pool: PoolDep, rid: RequestIdDep) -> JSONResponse:
    serving = len(pool.serving())
    shown = {"ready": serving > 0, "serving": serving, "replicas": len(pool.replicas)}
    if not serving:
        shown = {**error_body(503, "no replica serves yet", None, rid), **shown}
    return JSONResponse(shown, 200 if serving else 503)


@admin
async def health_replicas(pool: PoolDep) -> dict[str, Any]:
    return {
        "replicas": [pool.snapshot(r) for r in pool.replicas.values()],
        "control_state": control_state(pool),
        "queue_depth": pool.admission.queue_depth,
    }


@public
async def prometheus(pool: PoolDep, metrics: MetricsDep) -> Response:
    return Response(metrics.render(pool), media_type="text/plain; version=0.0.4")


def router() -> APIRouter:
    api = APIRouter()
    api.get("/health")(health)
    api.get("/livez")(livez)
    api.get("/ready")(ready)
    api.get("/health/replicas")(health_replicas)
    api.get("/metrics")(prometheus)
    return api
