"""The router's HTTP front: the app factory, its lifespan, error handlers and middleware.

The lifespan owns the replica pool (sockets and background tasks) and puts what
routes need on ``app.state`` (dpserve/router/deps.py); the routes live in
dpserve/router/routes/, one ``APIRouter`` per area, each handler parsing, calling the
service, and shaping the answer, and declaring which key it needs (the auth
middleware's table is built from the app's routes, dpserve/router/access.py). Every
failure leaves as JSON in OpenAI's error shape with a message that says what to fix,
and the request's id.
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from dpserve.contract import protocol as p
from dpserve.contract import realtime as rt
from dpserve.router.access import Levels
from dpserve.router.auth import AuthMiddleware, Keys, document_security
from dpserve.router.bodies import BadBody
from dpserve.router.bucket import BucketStore
from dpserve.router.deps import Running
from dpserve.router.desired import DesiredState
from dpserve.router.hosts import AllowedHosts
from dpserve.router.http_server import GuardedConfig
from dpserve.router.job_records import JobRecords
from dpserve.router.leases import Leases, lease_seconds
from dpserve.router.metrics import MetricsMiddleware, RouterMetrics
from dpserve.router.openai_api import INTERNAL_MESSAGE, error_body
from dpserve.router.playground import routes as playground
from dpserve.router.pool import ReplicaPool
from dpserve.router.registry import Registry
from dpserve.router.request_ids import RequestIdMiddleware, of_scope
from dpserve.router.routes import (
    control,
    docs,
    flat,
    health,
    images,
    info,
    realtime,
    usage,
    videos,
)
from dpserve.router.routes.images import REPLICA_HEADER
from dpserve.router.service import RouterService
from dpserve.router.sessions import SessionRouter
from dpserve.router.settings import KubernetesDiscovery, RouterSettings
from dpserve.router.slots import SlotLimits
from dpserve.router.store import OutputStore
from dpserve.router.tenants import KEYLESS
from dpserve.router.videos import VideoJobs
from dpserve.router.webhooks import Webhooks
from dpserve.sources.outstore import VideoObjects

__all__ = [
    "REPLICA_HEADER",
    "KubernetesDiscovery",
    "RouterSettings",
    "create_app",
    "server_config",
]

log = logging.getLogger(__name__)


@asynccontextmanager
async def lifespan(app: FastAPI) -> AsyncIterator[None]:
    settings: RouterSettings = app.state.settings
    _warn_about_keys(Keys.of(settings.api_keys, settings.admin_keys))
    k8s = settings.kubernetes
    if k8s is None:
        pool = ReplicaPool(settings.pool)
        await pool.set_endpoints(settings.workers)
        discovery = None
    else:
        from dpserve.plumbing import kubeconfig
        from dpserve.router import kubernetes as kube

        kubeconfig.load_config()
        store = (
            kube.ConfigMapStateStore(k8s.namespace, k8s.control_state_configmap)
            if k8s.control_state_configmap
            else None
        )
        pool = ReplicaPool(settings.pool, desired=DesiredState(store))
        discovery = kube.EndpointSliceDiscovery(k8s.namespace, k8s.service, pool.set_endpoints)
        await discovery.start()
    await pool.start()
    webhooks = None
    if settings.webhook is not None:
        count = app.state.metrics.webhook_events
        webhooks = Webhooks(settings.webhook, lambda kind, end: count.labels(kind, end).inc())
        webhooks.start()
        app.state.metrics.webhook_waiting.set_function(lambda: webhooks.waiting)
    objects = None if settings.output_s3 is None else VideoObjects(settings.output_s3)
    poll_s = settings.video_poll_s
    jobs = VideoJobs(
        pool,
        poll_s,
        settings.video_max_estimate_s,
        on_finish=webhooks.emit if webhooks is not None else None,
        objects=objects,
        leases=None if objects is None else Leases(JobRecords(objects), lease_seconds(poll_s)),
    )
    jobs.start()
    app.state.metrics.video_jobs.set_function(lambda: jobs.watched)
    app.state.running = Running(pool, RouterService(pool), SessionRouter(pool), Registry(), jobs)
    try:
        yield
    finally:
        app.state.running = None
        await jobs.close()
        if webhooks is not None:
            await webhooks.close()
        if discovery is not None:
            await discovery.stop()
        await pool.close()


def output_store(settings: RouterSettings) -> OutputStore | BucketStore | None:
    """Where url images go (docs/outputs.md). A folder's file lives no longer than its
    link: the shorter of --output-max-age and --output-url-ttl."""
    if settings.output_s3 is not None:
        return BucketStore(settings.output_s3, settings.output_url_ttl_s)
    if settings.output_dir is None:
        return None
    return OutputStore(
        settings.output_dir,
        settings.public_url,
        settings.output_max_files,
        min(settings.output_max_age_s, settings.output_url_ttl_s),
    )


def create_app(settings: RouterSettings) -> FastAPI:
    # The schema and its pages are the docs area's: the same, with their files served here.
    app = FastAPI(
        title="dpserve router",
        lifespan=lifespan,
        openapi_url=None,
        docs_url=None,
        redoc_url=None,
    )
    settings.check()  # ValueError: a weight names a tenant no key has
    keys = Keys.of(settings.api_keys, settings.admin_keys)
    app.state.settings = settings
    app.state.started = int(time.time())  # the Model object's created
    # Usage is labelled by tenant: the configured ones, or the one keyless tenant.
    app.state.metrics = RouterMetrics(keys.tenants if keys.enabled else (KEYLESS.tenant,))
    app.state.running = None
    app.state.store = output_store(settings)
    _handle_errors(app)
    for area in (images, videos, info, control, health, usage, realtime, docs, playground):
        # Each area's routes join the app's own list: an included router is one node
        # that routing enters and matches again per request (FastAPI 0.137+), which
        # doubled the cost of a trivial request (bench/router_overhead.py).
        app.router.routes.extend(area.router().routes)
    app.mount(docs.ASSETS, docs.assets(), name="docs-assets")
    levels = Levels.of(flat(app.routes))  # ValueError: a route declares no level

    # Outermost last: the request id is on every answer, refusals included, and
    # metrics count the refusals too.
    hosts = AllowedHosts.of(settings.allowed_hosts, settings.public_url)
    app.add_middleware(AuthMiddleware, keys=keys, levels=levels, hosts=hosts)
    app.add_middleware(RequestIdMiddleware)
    if keys.enabled:
        plain_openapi = app.openapi
        app.openapi = lambda: document_security(plain_openapi(), levels)  # type: ignore[method-assign]
    app.add_middleware(MetricsMiddleware, metrics=app.state.metrics)
    return app


def _error(
    request: Request,
    status: int,
    message: str,
    fields: list[p.FieldError] | None = None,
    code: str | None = None,
) -> JSONResponse:
    headers = {"Retry-After": "1"} if status in (429, 503) else None
    body = error_body(status, message, fields, of_scope(request.scope), code)
    return JSONResponse(body, status_code=status, headers=headers)


def _handle_errors(app: FastAPI) -> None:
    @app.exception_handler(p.RequestError)
    async def on_request_error(request: Request, exc: p.RequestError) -> JSONResponse:
        return _error(request, exc.status, str(exc), exc.fields, exc.code)

    @app.exception_handler(BadBody)
    async def on_bad_body(request: Request, exc: BadBody) -> JSONResponse:
        return _error(request, exc.status, str(exc))

    @app.exception_handler(StarletteHTTPException)
    async def on_http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        message = str(exc.detail)
        if exc.status_code == 404:
            message = f"no route {request.method} {request.url.path}; see GET /docs"
        elif exc.status_code == 405:
            message = f"{request.method} is not allowed on {request.url.path}"
        return _error(request, exc.status_code, message)

    @app.exception_handler(Exception)
    async def on_crash(request: Request, exc: Exception) -> JSONResponse:
        # Still a bug (the server logs the traceback), but answered in the error shape
        # rather than as plain text.
        return _error(request, 500, INTERNAL_MESSAGE)

    @app.exception_handler(RequestValidationError)
    async def on_validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        return _error(request, 422, f"invalid request: {exc.errors()}")


def server_config(app: FastAPI, host: str, port: int, settings: RouterSettings) -> uvicorn.Config:
    """How the router is served (dpserve/router/http_server.py: the head deadline and the
    connection slots). Frames are PNG or JPEG already: WebSocket compression would only
    spend CPU on both ends of every frame."""
    slots = SlotLimits(settings.max_connections, settings.max_connections_per_peer)
    return GuardedConfig(
        app,
        slots=slots,
        header_timeout_s=settings.header_timeout_s,
        host=host,
        port=port,
        ws_per_message_deflate=False,
        ws_max_size=rt.MAX_MESSAGE_BYTES,
        backlog=settings.backlog,
    )


def _warn_about_keys(keys: Keys) -> None:
    if not keys.enabled:
        log.warning(
            "NO API KEYS: anyone who reaches this router can generate, swap the weights "
            "(update_weights_from_disk), change LoRAs and release GPU memory. Start it with "
            "--api-key/--admin-key (or --api-key-file/--admin-key-file)."
        )
    elif not keys.admin:
        log.warning("no admin key is configured: control routes answer 403 to every caller")
