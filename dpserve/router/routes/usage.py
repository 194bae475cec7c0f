"""``GET /v1/usage``: each tenant's totals since this router started (docs/tenants.md).
An admin's: it names every tenant and what each used. The totals are the ones
``/metrics`` shows (dpserve/router/usage.py), from this router only: a service with
several routers sums their scrapes."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from dpserve.router import schemas
from dpserve.router.access import admin
from dpserve.router.deps import MetricsDep


@admin
async def usage(request: Request, metrics: MetricsDep) -> JSONResponse:
    shown = {"object": "usage", "since": request.app.state.started}
    return JSONResponse({**shown, "tenants": metrics.usage.report()})


def router() -> APIRouter:
    api = APIRouter()
    api.get(
        "/v1/usage",
        response_model=schemas.UsageResponse,
        responses={
            401: {"model": schemas.ErrorResponse, "description": "no key, or not a valid one"},
            403: {"model": schemas.ErrorResponse, "description": "not an admin key"},
        },
    )(usage)
    return api
