"""Control ops (SGLang's routes), fanned out to every replica by the service layer.
Each needs an admin key: it changes or reads the replicas' state."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel

from dpserve.contract import protocol as p
from dpserve.router import schemas
from dpserve.router.access import admin
from dpserve.router.bodies import parse_object, read_body
from dpserve.router.deps import RequestIdDep, ServiceDep, SettingsDep
from dpserve.router.openai_api import error_body


@dataclass(frozen=True)
class ControlRoute:
    path: str
    op: str
    body: type[BaseModel]  # what /openapi.json declares the op takes
    needs_body: bool = False


ROUTES: Final = (
    ControlRoute(
        "/update_weights_from_disk",
        "update_weights_from_disk",
        schemas.UpdateWeightsRequest,
        needs_body=True,
    ),
    ControlRoute("/release_memory_occupation", "release_memory_occupation", schemas.NoArgs),
    ControlRoute("/resume_memory_occupation", "resume_memory_occupation", schemas.NoArgs),
    ControlRoute("/v1/set_lora", "set_lora", schemas.SetLoraRequest, needs_body=True),
    ControlRoute("/v1/merge_lora_weights", "merge_lora_weights", schemas.MergeLoraRequest),
    ControlRoute("/v1/unmerge_lora_weights", "unmerge_lora_weights", schemas.UnmergeLoraRequest),
    ControlRoute("/v1/list_loras", "list_loras", schemas.NoArgs),
    ControlRoute("/get_weights_checksum", "get_weights_checksum", schemas.ChecksumRequest),
)


def _handler(op: str):  # type: ignore[no-untyped-def]
    @admin
    async def handler(
        request: Request, rid: RequestIdDep, settings: SettingsDep, service: ServiceDep
    ) -> JSONResponse:
        raw = await read_body(request, settings.max_body_bytes, settings.body_timeout_s)
        body = parse_object(raw, request.headers.get("content-type"), required=False)
        answer = await service.control(op, body)
        shown = answer.body
        if answer.status >= 400:  # the one error shape, beside SGLang's success and message
            error = error_body(answer.status, str(shown["message"]), None, rid, answer.code)
            shown = {**error, **shown}
        return JSONResponse(shown, status_code=answer.status)

    return handler


def router() -> APIRouter:
    api = APIRouter()
    for route in ROUTES:
        path, op, handler = route.path, route.op, _handler(route.op)
        extra = schemas.request_body(route.body, route.needs_body)
        api.add_api_route(path, handler, methods=["POST"], name=op, openapi_extra=extra)
        if op in p.READ_ONLY_OPS:  # also a GET (its body, if any, is read the same way)
            api.add_api_route(path, handler, methods=["GET"], name=op, openapi_extra={})
    return api
