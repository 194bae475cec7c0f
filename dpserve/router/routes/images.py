"""Image routes: generations, edits, cancel by id, stored files. Each handler parses,
hands the request to a job (dpserve/router/jobs.py) and shapes the answer."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Sequence
from typing import Any, TypeVar

from fastapi import APIRouter, Request, Response
from fastapi.responses import FileResponse, JSONResponse

from dpserve.contract import protocol as p
from dpserve.router import deps, fields, jobs, schemas
from dpserve.router.access import inference, public
from dpserve.router.bodies import BadBody, parse_object, read_body
from dpserve.router.bucket import StoreDown
from dpserve.router.deps import (
    ImageStore,
    MetricsDep,
    PoolDep,
    RegistryDep,
    RequestIdDep,
    ServiceDep,
    SettingsDep,
    StoreDep,
)
from dpserve.router.forms import EditForm, read_edit
from dpserve.router.metrics import RouterMetrics
from dpserve.router.openai_api import (
    ImageRequest,
    check_edit_supported,
    image_response,
    parse_image_request,
)
from dpserve.router.pool import ReplicaPool
from dpserve.router.registry import (
    CANCELLED,
    COMPLETED,
    QUEUED_AT_REPLICA,
    RUNNING_AT_REPLICA,
    Registry,
)
from dpserve.router.request_ids import RULE, valid
from dpserve.router.served_model import check_model
from dpserve.router.service import RouterService
from dpserve.router.settings import RouterSettings
from dpserve.router.store import OutputStore, owner
from dpserve.router.streaming import EDIT, GENERATION, EventStream
from dpserve.router.tenants import may_open, presented_of, principal_of

T = TypeVar("T")
REPLICA_HEADER = "X-Dpserve-Replica"


@inference
async def generate(
    request: Request,
    rid: RequestIdDep,
    settings: SettingsDep,
    pool: PoolDep,
    service: ServiceDep,
    registry: RegistryDep,
    store: StoreDep,
    metrics: MetricsDep,
) -> Response:
    raw = await read_body(request, settings.max_body_bytes, settings.body_timeout_s)
    body = parse_object(raw, request.headers.get("content-type"), required=True)
    asked = parse_image_request(
        body,
        deps.limits(pool),
        store is not None,
        deps.features(pool),
        served=deps.served_name(pool, settings),
    )
    meter = metrics.meter(request.scope)
    params = pool.loras.resolve(asked.params)
    job = jobs.start(registry, service, rid, params, meter=meter, tenant=_tenant(request))
    return await _answer(request, job, asked, GENERATION, store)


@inference
async def edit(
    request: Request,
    rid: RequestIdDep,
    settings: SettingsDep,
    pool: PoolDep,
    service: ServiceDep,
    registry: RegistryDep,
    store: StoreDep,
    metrics: MetricsDep,
) -> Response:
    form = await read_edit(request, settings.max_upload_bytes, settings.body_timeout_s)
    return await _edit(
        request, rid, form, form.body(), settings, pool, service, registry, store, metrics
    )


@inference
async def variation(
    request: Request,
    rid: RequestIdDep,
    settings: SettingsDep,
    pool: PoolDep,
    service: ServiceDep,
    registry: RegistryDep,
    store: StoreDep,
    metrics: MetricsDep,
) -> Response:
    """OpenAI's variations: an image-to-image edit of one image without a prompt."""
    form = await read_edit(request, settings.max_upload_bytes, settings.body_timeout_s)
    body = form.variation_body()
    return await _edit(request, rid, form, body, settings, pool, service, registry, store, metrics)


async def _edit(
    request: Request,
    rid: str,
    form: EditForm,
    body: dict[str, Any],
    settings: RouterSettings,
    pool: ReplicaPool,
    service: RouterService,
    registry: Registry,
    store: ImageStore | None,
    metrics: RouterMetrics,
) -> Response:
    check_model(body.get("model"), deps.served_name(pool, settings))
    features = deps.features(pool)
    check_edit_supported(features, form.mask is not None)
    blobs = form.blobs()
    limits = deps.limits(pool)
    asked = parse_image_request(body, limits, store is not None, features, len(blobs), fields.EDITS)
    job = jobs.start(
        registry,
        service,
        rid,
        pool.loras.resolve(asked.params),
        blobs,
        meter=metrics.meter(request.scope),
        tenant=_tenant(request),
    )
    return await _answer(request, job, asked, EDIT, store)


def _tenant(request: Request) -> str:
    """Whose share of the replicas the request waits in (docs/tenants.md)."""
    return principal_of(request.scope).tenant


async def _answer(
    request: Request, job: jobs.Job, asked: ImageRequest, kind: str, store: ImageStore | None
) -> Response:
    rid = job.entry.request_id
    if asked.stream:
        return EventStream(jobs.events(job, kind))
    done = await jobs.result(job, lambda work: _unless_disconnected(request, work))
    urls = None
    if asked.response_format == "url" and store is not None:
        tenant, fmt = principal_of(request.scope).tenant, asked.params.output_format
        urls = await _saved(store, done.images, fmt, tenant)
    return JSONResponse(
        image_response(rid, done.result, done.images, urls),
        headers={REPLICA_HEADER: done.replica},
    )


async def _saved(store: ImageStore, images: Sequence[bytes], fmt: str, tenant: str) -> list[str]:
    """The images in the output store, their links. A bucket is written off the event
    loop; one that does not take them is a 503 that says so (the images are lost)."""
    if isinstance(store, OutputStore):
        return [store.save(img, fmt, tenant) for img in images]
    try:
        return await asyncio.to_thread(lambda: [store.save(img, fmt, tenant) for img in images])
    except StoreDown as exc:
        raise p.RequestError(
            p.UNAVAILABLE,
            f"the image was made but could not be stored: {exc}; retry, or ask "
            "for response_format=b64_json",
        ) from None


@inference
async def cancel(
    request_id: str, request: Request, registry: RegistryDep, service: ServiceDep
) -> JSONResponse:
    """Cancel a generation or an edit of the caller's tenant by its id, wherever it is:
    queued in this router, queued at or running on a replica, or admitted by another
    router of the service. Another tenant's request is unknown (404)."""
    if not valid(request_id):
        raise BadBody(400, f"{request_id[:40]!r} is not a request id ({RULE})")
    scope = principal_of(request.scope).scope
    entry = registry.cancel(request_id, scope)
    if entry is not None:
        return _cancelled(request_id, entry.stage)
    ended = registry.finished(request_id, scope)
    if ended is not None:
        raise p.RequestError(p.CONFLICT, _too_late(request_id, ended))
    found = await service.cancel_elsewhere(request_id, scope)
    if found != p.CANCEL_NOT_FOUND:
        stage = RUNNING_AT_REPLICA if found == p.CANCEL_RUNNING else QUEUED_AT_REPLICA
        return _cancelled(request_id, stage)
    raise p.RequestError(
        p.NOT_FOUND,
        f"no request {request_id!r} is queued or running on this router or its replicas "
        "(finished ones are remembered here for a while only)",
    )


def _cancelled(request_id: str, stage: str) -> JSONResponse:
    body = schemas.CancelResponse(id=request_id, stage=stage)
    return JSONResponse(body.model_dump())


def _too_late(request_id: str, ended: str) -> str:
    if ended == COMPLETED:
        return f"request {request_id!r} already completed; there is nothing to cancel"
    if ended == CANCELLED:
        return f"request {request_id!r} was already cancelled"
    return f"request {request_id!r} already failed; there is nothing to cancel"


# A stored image's name holds 122 random bits (a UUID4): the URL is the capability, like
# a presigned URL, so an image link opens in a browser (which sends no key). A key sent
# anyway must be one of the image's tenant (docs/tenants.md, "Ownership").
@public
async def stored_image(name: str, request: Request, store: StoreDep) -> Response:
    # A bucket's links go to the store itself: nothing of it is served here.
    path = store.path(name) if isinstance(store, OutputStore) else None
    if path is None or not may_open(presented_of(request.scope), owner(name)):
        raise p.RequestError(p.NOT_FOUND, f"no stored image {name[:80]!r}")
    return FileResponse(path)


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


def router() -> APIRouter:
    api = APIRouter()
    api.post(
        "/v1/images/generations",
        openapi_extra=schemas.request_body(schemas.ImageGenerationRequest, required=True),
        responses=schemas.image_responses(),
    )(generate)
    api.post(
        "/v1/images/edits",
        openapi_extra=schemas.request_body(
            schemas.ImageEditForm, required=True, media_type="multipart/form-data"
        ),
        responses=schemas.image_responses(),
    )(edit)
    api.post(
        "/v1/images/variations",
        openapi_extra=schemas.request_body(
            schemas.ImageVariationForm, required=True, media_type="multipart/form-data"
        ),
        responses=schemas.image_responses(),
    )(variation)
    api.post(
        "/v1/images/{request_id}/cancel",
        response_model=schemas.CancelResponse,
        responses={
            400: {"model": schemas.ErrorResponse, "description": "not a request id"},
            404: {"model": schemas.ErrorResponse, "description": "no such request"},
            409: {"model": schemas.ErrorResponse, "description": "it already finished"},
        },
    )(cancel)
    api.get("/v1/images/files/{name}")(stored_image)
    return api
