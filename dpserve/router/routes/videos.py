"""Video routes (OpenAI's ``/v1/videos``): each handler parses (dpserve/router/video_api.py),
asks the video jobs service (dpserve/router/videos.py) for the caller's tenant's jobs
(dpserve/router/tenants.py) and shapes the answer. The
response models only document (JSONResponse skips FastAPI's checking of them)."""

from __future__ import annotations

from fastapi import APIRouter, Request, Response
from fastapi.responses import JSONResponse

from dpserve.router import deps, video_api, video_schemas
from dpserve.router.access import inference
from dpserve.router.deps import MetricsDep, PoolDep, SettingsDep, VideosDep
from dpserve.router.routes.info import model_name
from dpserve.router.tenants import principal_of


@inference
async def create(
    request: Request,
    settings: SettingsDep,
    pool: PoolDep,
    videos: VideosDep,
    metrics: MetricsDep,
) -> JSONResponse:
    asked = await video_api.read_create(
        request, settings.max_body_bytes, settings.max_upload_bytes, settings.body_timeout_s
    )
    served = deps.served_name(pool, settings)
    params = video_api.parse_create(asked, deps.limits(pool), deps.features(pool), served)
    params = pool.loras.resolve(params)
    tenant = principal_of(request.scope).tenant
    job = await videos.submit(params, asked.blobs, tenant, metrics.meter(request.scope))
    return JSONResponse(video_api.job_json(job, model_name(pool, settings)))


@inference
async def retrieve(
    video_id: str, request: Request, settings: SettingsDep, pool: PoolDep, videos: VideosDep
) -> JSONResponse:
    held = await videos.find(video_id, _scope(request))
    return JSONResponse(video_api.job_json(held.job, model_name(pool, settings)))


@inference
async def list_videos(
    request: Request, settings: SettingsDep, pool: PoolDep, videos: VideosDep
) -> JSONResponse:
    query = video_api.parse_list(request.query_params)
    jobs, has_more = video_api.page(await videos.all_jobs(_scope(request)), query)
    return JSONResponse(video_api.list_json(jobs, has_more, model_name(pool, settings)))


@inference
async def content(
    video_id: str, request: Request, videos: VideosDep, variant: str = "video"
) -> Response:
    meta, data = await videos.content(video_id, variant, _scope(request))
    disposition = f'attachment; filename="{video_api.filename(video_id, meta.variant)}"'
    return Response(data, media_type=meta.media_type, headers={"Content-Disposition": disposition})


@inference
async def delete(video_id: str, request: Request, videos: VideosDep) -> JSONResponse:
    job = await videos.delete(video_id, _scope(request))
    return JSONResponse(video_api.deleted_json(job.id))


def _scope(request: Request) -> str | None:
    """Whose jobs the caller sees (dpserve/router/tenants.py)."""
    return principal_of(request.scope).scope


def router() -> APIRouter:
    schemas = video_schemas
    api = APIRouter()
    api.post(
        "/v1/videos",
        openapi_extra=schemas.create_body(),
        response_model=schemas.VideoObject,
        responses=schemas.errors(400, 429, 503),
    )(create)
    api.get(
        "/v1/videos",
        response_model=schemas.VideoListResponse,
        responses=schemas.errors(400),
        openapi_extra={"parameters": _LIST_PARAMETERS},
    )(list_videos)
    api.get(
        "/v1/videos/{video_id}",
        response_model=schemas.VideoObject,
        responses=schemas.errors(404),
    )(retrieve)
    api.get(
        "/v1/videos/{video_id}/content",
        response_class=Response,
        responses={
            200: {"content": {"video/mp4": {}, "image/jpeg": {}}, "description": "the file"},
            **schemas.errors(400, 404, 409),
        },
    )(content)
    api.delete(
        "/v1/videos/{video_id}",
        response_model=schemas.VideoDeleted,
        responses=schemas.errors(404),
    )(delete)
    return api


_LIST_PARAMETERS = [
    {"name": "after", "in": "query", "schema": {"type": "string"}, "description": "a video id"},
    {
        "name": "limit",
        "in": "query",
        "schema": {"type": "integer", "minimum": 1, "maximum": video_api.MAX_LIMIT},
    },
    {"name": "order", "in": "query", "schema": {"type": "string", "enum": list(video_api.ORDERS)}},
]
