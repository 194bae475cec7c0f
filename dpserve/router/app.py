"""The router's HTTP front: FastAPI routes as one-liners over the service layer.

The lifespan owns the replica pool (sockets and background tasks); routes parse,
call the service, and shape the answer. Every failure leaves as JSON in OpenAI's
error shape with a message that says what to fix.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Awaitable
from contextlib import asynccontextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import uvicorn
from fastapi import FastAPI, Request, Response, WebSocket
from fastapi.exceptions import RequestValidationError
from fastapi.responses import FileResponse, JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from dpserve import protocol as p
from dpserve import realtime as rt
from dpserve.layout import ParallelConfig, describe
from dpserve.router import schemas
from dpserve.router.auth import AuthMiddleware, Keys, document_security
from dpserve.router.bodies import BadBody, parse_object, read_body
from dpserve.router.desired import DesiredState
from dpserve.router.metrics import MetricsMiddleware, RouterMetrics
from dpserve.router.openai_api import error_body, image_response, parse_image_request
from dpserve.router.policies import FanoutAnswer
from dpserve.router.pool import PoolSettings, ReplicaPool
from dpserve.router.realtime_ws import RealtimeConnection, RealtimeSettings
from dpserve.router.service import RouterService
from dpserve.router.sessions import SessionRouter
from dpserve.router.store import OutputStore

log = logging.getLogger(__name__)
T = TypeVar("T")

REPLICA_HEADER = "X-Dpserve-Replica"


@dataclass(frozen=True)
class KubernetesDiscovery:
    """Replicas are the ready endpoints of a headless Service; the control state is kept
    in a ConfigMap."""

    namespace: str
    service: str
    control_state_configmap: str | None = None


@dataclass(frozen=True)
class RouterSettings:
    workers: tuple[str, ...] = ()
    kubernetes: KubernetesDiscovery | None = None
    pool: PoolSettings = field(default_factory=PoolSettings)
    realtime: RealtimeSettings = field(default_factory=RealtimeSettings)
    max_body_bytes: int = 1 << 20
    output_dir: Path | None = None
    public_url: str = "http://127.0.0.1:8000"
    served_model_name: str | None = None
    # Bearer keys (docs/router.md, "Security"): none configured, every route is open.
    api_keys: tuple[str, ...] = field(default=(), repr=False)
    admin_keys: tuple[str, ...] = field(default=(), repr=False)  # also work on inference routes
    body_timeout_s: float = 30.0  # a body not fully read by then is refused (408)
    # The HTTP server's edges (docs/router.md, "Limits"): connections (WebSockets
    # included) past max_connections get 503 at once; the kernel queues backlog more.
    max_connections: int = 1000
    backlog: int = 2048
    # response_format=url files: the oldest go past either bound (docs/router.md).
    output_max_files: int = 1000
    output_max_age_s: float = 3600.0


@dataclass
class _Running:
    """What the lifespan opened; routes reach it only while the app runs."""

    pool: ReplicaPool | None = None
    service: RouterService | None = None
    sessions: SessionRouter | None = None


def _error(status: int, message: str, fields: list[p.FieldError] | None = None) -> JSONResponse:
    headers = {"Retry-After": "1"} if status in (429, 503) else None
    return JSONResponse(error_body(status, message, fields), status_code=status, headers=headers)


def _fanout(answer: FanoutAnswer) -> JSONResponse:
    return JSONResponse(answer.body, status_code=answer.status)


async def _json_body(request: Request, settings: RouterSettings, required: bool) -> Any:
    """The parsed JSON object body (dpserve/router/bodies.py says what is refused)."""
    raw = await read_body(request, settings.max_body_bytes, settings.body_timeout_s)
    return parse_object(raw, request.headers.get("content-type"), required)


async def _unless_disconnected(request: Request, work: Awaitable[T]) -> T:
    """Await ``work``, cancelling it when the client goes away: a request waiting for a
    slot leaves the router's queue, and one a replica has is cancelled there (the
    replica drops it at its next denoising step, which frees it for the next request).

    The body has been read, so the server's next message is the disconnect: waiting
    on it costs nothing per request, where polling cost CPU for every one in flight.
    """
    task = asyncio.ensure_future(work)
    gone = asyncio.ensure_future(_disconnect(request))
    try:
        await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
        if task.done():
            return task.result()
        raise BadBody(499, "client closed the request")
    finally:
        for pending in (task, gone):
            if not pending.done():
                pending.cancel()


async def _disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


def create_app(settings: RouterSettings) -> FastAPI:
    metrics = RouterMetrics()
    store = (
        OutputStore(
            settings.output_dir,
            settings.public_url,
            settings.output_max_files,
            settings.output_max_age_s,
        )
        if settings.output_dir
        else None
    )
    running = _Running()

    keys = Keys.of(settings.api_keys, settings.admin_keys)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        _warn_about_keys(keys)
        k8s = settings.kubernetes
        if k8s is None:
            pool = ReplicaPool(settings.pool)
            await pool.set_endpoints(settings.workers)
            discovery = None
        else:
            from dpserve.router import kubernetes as kube

            kube.load_config()
            store = (
                kube.ConfigMapStateStore(k8s.namespace, k8s.control_state_configmap)
                if k8s.control_state_configmap
                else None
            )
            pool = ReplicaPool(settings.pool, desired=DesiredState(store))
            discovery = kube.EndpointSliceDiscovery(k8s.namespace, k8s.service, pool.set_endpoints)
            await discovery.start()
        await pool.start()
        running.pool, running.service = pool, RouterService(pool)
        running.sessions = SessionRouter(pool)
        try:
            yield
        finally:
            if discovery is not None:
                await discovery.stop()
            await pool.close()

    app = FastAPI(title="dpserve router", lifespan=lifespan)

    def pool() -> ReplicaPool:
        assert running.pool is not None, "used outside the app's lifespan"
        return running.pool

    def service() -> RouterService:
        assert running.service is not None, "used outside the app's lifespan"
        return running.service

    # ------------------------------------------------------------ errors and metrics

    @app.exception_handler(p.RequestError)
    async def on_request_error(request: Request, exc: p.RequestError) -> JSONResponse:
        return _error(exc.status, str(exc), exc.fields)

    @app.exception_handler(BadBody)
    async def on_bad_body(request: Request, exc: BadBody) -> JSONResponse:
        return _error(exc.status, str(exc))

    @app.exception_handler(StarletteHTTPException)
    async def on_http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        message = str(exc.detail)
        if exc.status_code == 404:
            message = f"no route {request.method} {request.url.path}; see GET /docs"
        elif exc.status_code == 405:
            message = f"{request.method} is not allowed on {request.url.path}"
        return _error(exc.status_code, message)

    @app.exception_handler(Exception)
    async def on_crash(request: Request, exc: Exception) -> JSONResponse:
        # Still a bug (the server logs the traceback), but answered in the error shape
        # rather than as plain text, and without the exception's words (paths, state).
        return _error(500, "internal error in the router; it is logged there")

    @app.exception_handler(RequestValidationError)
    async def on_validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        return _error(422, f"invalid request: {exc.errors()}")

    # Outermost last: metrics count the refusals too.
    app.add_middleware(AuthMiddleware, keys=keys)
    if keys.enabled:
        plain_openapi = app.openapi
        app.openapi = lambda: document_security(plain_openapi())  # type: ignore[method-assign]
    app.add_middleware(MetricsMiddleware, metrics=metrics)

    # ------------------------------------------------------------ generation

    @app.post(
        "/v1/images/generations",
        openapi_extra=schemas.request_body(schemas.ImageGenerationRequest, required=True),
    )
    async def generate(request: Request) -> JSONResponse:
        body = await _json_body(request, settings, required=True)
        params, fmt = parse_image_request(body, _limits(pool()), store is not None)
        done = await _unless_disconnected(request, service().generate(params))
        urls = None
        if fmt == "url" and store is not None:
            urls = [store.save(img, params.output_format) for img in done.images]
        return JSONResponse(
            image_response(done.result, done.images, urls),
            headers={REPLICA_HEADER: done.replica},
        )

    @app.websocket("/v1/realtime_video/generate")
    async def realtime(ws: WebSocket) -> None:
        assert running.sessions is not None, "used outside the app's lifespan"
        limits = lambda: _limits(pool())  # noqa: E731  (read when each init arrives)
        await RealtimeConnection(ws, running.sessions, limits, settings.realtime).run()

    @app.get("/v1/images/files/{name}")
    async def stored_image(name: str) -> Response:
        path = store.path(name) if store is not None else None
        if path is None:
            return _error(404, f"no stored image {name!r}")
        return FileResponse(path)

    # ------------------------------------------------------------ information

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {
            "object": "list",
            "data": [
                {"id": _model_name(pool(), settings), "object": "model", "owned_by": "dpserve"}
            ],
        }

    @app.get("/model_info")
    async def model_info() -> JSONResponse:
        infos = [r.info for r in pool().serving() if r.info is not None]
        if not infos:
            return _error(503, "no replica is serving yet")
        return JSONResponse({**infos[0], "replicas_serving": len(infos)})

    @app.get("/server_info")
    async def server_info() -> dict[str, Any]:
        replicas = list(pool().replicas.values())
        info = next((r.info for r in replicas if r.info is not None), None) or {}
        return {
            "replicas": len(replicas),
            "serving": len(pool().serving()),
            "model": _model_name(pool(), settings),
            "layout": _layout(info, len(replicas)),
            "threads_per_rank": info.get("threads_per_rank"),
            # Each rank's weight bytes per module (a serving replica's; the same layout
            # everywhere): tensor parallel's split and the encoders' placement show here.
            "rank_weights": info.get("rank_weights"),
            "router": _shown_settings(settings),
            "control_state": _control_state(pool()),
            "replica_states": [pool().snapshot(r) for r in replicas],
        }

    # ------------------------------------------------------------ control fan-out

    async def fan_out(op: str, request: Request) -> JSONResponse:
        body = await _json_body(request, settings, required=False)
        return _fanout(await service().control(op, body))

    def control_route(path: str, op: str, methods: list[str], extra: dict[str, Any]) -> None:
        async def handler(request: Request) -> JSONResponse:
            return await fan_out(op, request)

        app.add_api_route(path, handler, methods=methods, name=op, openapi_extra=extra)

    for path, op in (
        ("/update_weights_from_disk", "update_weights_from_disk"),
        ("/release_memory_occupation", "release_memory_occupation"),
        ("/resume_memory_occupation", "resume_memory_occupation"),
        ("/v1/set_lora", "set_lora"),
        ("/v1/merge_lora_weights", "merge_lora_weights"),
        ("/v1/unmerge_lora_weights", "unmerge_lora_weights"),
        ("/v1/list_loras", "list_loras"),
        ("/get_weights_checksum", "get_weights_checksum"),
    ):
        control_route(path, op, ["POST"], schemas.control_body(op))
        if op in p.READ_ONLY_OPS:  # also a GET (its body, if any, is read the same way)
            control_route(path, op, ["GET"], {})

    # ------------------------------------------------------------ health

    @app.get("/health")
    async def health() -> JSONResponse:
        replicas = list(pool().replicas.values())
        silent = [pool().snapshot(r) for r in replicas if not r.answering]
        if not replicas or silent:
            message = "no replicas known" if not replicas else "some replicas do not answer"
            return JSONResponse({"status": "unhealthy", "message": message, "silent": silent}, 503)
        return JSONResponse({"status": "ok", "replicas": len(replicas)})

    @app.get("/livez")
    async def livez() -> dict[str, str]:
        """The process and its event loop are alive (replica health is /health's job)."""
        return {"status": "ok"}

    @app.get("/ready")
    async def ready() -> JSONResponse:
        serving = len(pool().serving())
        return JSONResponse(
            {"ready": serving > 0, "serving": serving, "replicas": len(pool().replicas)},
            200 if serving else 503,
        )

    @app.get("/health/replicas")
    async def health_replicas() -> dict[str, Any]:
        return {
            "replicas": [pool().snapshot(r) for r in pool().replicas.values()],
            "control_state": _control_state(pool()),
            "queue_depth": pool().queue_depth,
        }

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(metrics.render(pool()), media_type="text/plain; version=0.0.4")

    return app


def server_config(app: FastAPI, host: str, port: int, settings: RouterSettings) -> uvicorn.Config:
    """How the router is served. Frames are PNG or JPEG already: WebSocket
    compression would only spend CPU on both ends of every frame.

    uvicorn's ``limit_concurrency`` counts open connections (idle keep-alive ones and
    WebSockets too) and running requests: past it a new request gets 503 at once,
    so a flood costs the router a few bytes per connection, not its memory or its
    file descriptors (which the replicas' sockets need as well). uvicorn counts the
    new connection itself, hence the + 1: ``max_connections`` are served.
    """
    return uvicorn.Config(
        app,
        host=host,
        port=port,
        ws_per_message_deflate=False,
        ws_max_size=rt.MAX_MESSAGE_BYTES,
        limit_concurrency=settings.max_connections + 1,
        backlog=settings.backlog,
    )


def _limits(pool: ReplicaPool) -> p.Limits:
    """Router-side checks mirror what the replicas enforce, once one has told us."""
    info = next((r.info for r in pool.serving() if r.info is not None), None)
    if info is None:
        return p.Limits()
    factor = int(info.get("size_factor", 16))
    return p.Limits(
        size_factor=factor,
        min_side=factor,
        max_side=int(info.get("max_side", 2048)),
        max_steps=int(info.get("max_steps", 100)),
        sequence_split=int(info.get("parallel", {}).get("sp", 1)),
    )


def _control_state(pool: ReplicaPool) -> dict[str, Any] | None:
    """The state every serving replica holds: its version, the op that made it, a digest."""
    doc = pool.desired.doc
    if doc is None:
        return None
    return {
        "version": doc.version,
        "op": doc.op,
        "digest": doc.state.digest(),
        "state": doc.to_builtins()["state"],
    }


def _layout(info: dict[str, Any], replicas: int) -> str | None:
    """The deployment's layout: each replica's gang, with dp = the number of replicas."""
    gang = info.get("parallel")
    return describe(ParallelConfig(**gang, dp=max(replicas, 1))) if gang else None


def _shown_settings(settings: RouterSettings) -> dict[str, Any]:
    """The settings /server_info shows: no path of this host, no secret."""
    hidden = {"output_dir", "api_keys", "admin_keys"}
    shown = {k: v for k, v in asdict(settings).items() if k not in hidden}
    shown["auth"] = {"api_keys": len(settings.api_keys), "admin_keys": len(settings.admin_keys)}
    shown["pool"]["wire_key"] = "curve" if settings.pool.wire_key is not None else None
    return shown


def _warn_about_keys(keys: Keys) -> None:
    if not keys.enabled:
        log.warning(
            "NO API KEYS: anyone who reaches this router can generate, swap the weights "
            "(update_weights_from_disk), change LoRAs and release GPU memory. Start it with "
            "--api-key/--admin-key (or --api-key-file/--admin-key-file)."
        )
    elif not keys.admin:
        log.warning("no admin key is configured: control routes answer 403 to every caller")


def _model_name(pool: ReplicaPool, settings: RouterSettings) -> str:
    if settings.served_model_name:
        return settings.served_model_name
    info = next((r.info for r in pool.replicas.values() if r.info is not None), None)
    return Path(str(info["model_path"])).name if info else "dpserve"
