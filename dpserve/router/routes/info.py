"""What is served: the model, its features, the replicas and the router's settings.
``/server_info`` needs an admin key: it shows the control state (LoRA and weight
paths), the router's settings and each replica's endpoint and errors."""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

import msgspec
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from dpserve.contract import protocol as p
from dpserve.contract import validation as pv
from dpserve.contract.layout import ParallelConfig, describe
from dpserve.contract.model_info import ModelInfo
from dpserve.router import deps
from dpserve.router.access import admin, inference
from dpserve.router.deps import PoolDep, SettingsDep
from dpserve.router.fields import request_fields
from dpserve.router.lora_names import CATALOG
from dpserve.router.pool import ReplicaPool
from dpserve.router.schemas import ErrorResponse
from dpserve.router.served_model import UNKNOWN, model_not_found
from dpserve.router.settings import RouterSettings
from dpserve.router.tenants import principal_of


@inference
async def models(request: Request, pool: PoolDep, settings: SettingsDep) -> dict[str, Any]:
    return {"object": "list", "data": [_model(request, pool, settings)]}


@inference
async def model(
    model_id: str, request: Request, pool: PoolDep, settings: SettingsDep
) -> dict[str, Any]:
    """OpenAI's ``GET /v1/models/{id}``: the served model, or 404 model_not_found."""
    shown = _model(request, pool, settings)
    if model_id != shown["id"]:
        raise model_not_found(model_id, shown["id"])
    return shown


def _model(request: Request, pool: ReplicaPool, settings: RouterSettings) -> dict[str, Any]:
    """OpenAI's Model object (``created``: when this router started) and what it serves."""
    return {
        "id": model_name(pool, settings),
        "object": "model",
        "created": request.app.state.started,
        "owned_by": "dpserve",
        "features": msgspec.to_builtins(deps.features(pool)),
        "router_features": router_features(settings),
        "adapters": adapters(pool, principal_of(request.scope).sees_all),
    }


def adapters(pool: ReplicaPool, admin: bool) -> list[dict[str, Any]]:
    """The LoRA adapters requests may name alone (docs/lora.md). An admin sees every
    known one with its path, whether the service pins it (its set_lora adapters) and
    the replicas holding it; anyone else the names of the service's catalog (the
    registered and the service's own), not paths of its hosts nor other tenants' names."""
    known = pool.loras.known()
    if not admin:
        return [{"name": a.name} for a in known if a.source in CATALOG]
    doc = pool.desired.doc
    pinned = set(doc.state.loras) if doc is not None else set()
    holders: dict[str, list[str]] = {}
    for replica in pool.members():
        report = replica.adapters
        if report is None:
            continue
        pinned.update(report.pinned)
        for name in report.resident:
            holders.setdefault(name, []).append(replica.name)
    paths: dict[str, str | None] = {a.name: a.path for a in known}
    for name in holders:
        paths.setdefault(name, None)
    return [
        {
            "name": name,
            "path": paths[name],
            "resident": sorted(holders.get(name, [])),
            "pinned": name in pinned,
        }
        for name in sorted(paths)
    ]


@inference
async def model_info(pool: PoolDep, settings: SettingsDep) -> JSONResponse:
    """What an inference key may know of the model: not where its files are on the
    replicas' hosts (``model_path``, an admin's in /server_info)."""
    infos = [r.info for r in pool.serving() if r.info is not None]
    if not infos:
        raise p.RequestError(p.UNAVAILABLE, "no replica is serving yet")
    shown = {**msgspec.to_builtins(infos[0]), "replicas_serving": len(infos)}
    del shown["model_path"]
    shown.update(
        features=msgspec.to_builtins(deps.features(pool)), router_features=router_features(settings)
    )
    return JSONResponse(shown)


@admin
async def server_info(pool: PoolDep, settings: SettingsDep) -> dict[str, Any]:
    replicas = list(pool.replicas.values())
    info = next((r.info for r in replicas if r.info is not None), None)
    return {
        "replicas": len(replicas),
        "serving": len(pool.serving()),
        "model": model_name(pool, settings),
        "layout": _layout(info, len(replicas)),
        "model_path": info.model_path if info is not None else None,
        "threads_per_rank": info.threads_per_rank if info is not None else None,
        # Each rank's weight bytes per module (a serving replica's; the same layout
        # everywhere): tensor parallel's split and the encoders' placement show here.
        "rank_weights": msgspec.to_builtins(info.rank_weights) if info is not None else None,
        "features": msgspec.to_builtins(deps.features(pool)),
        "router_features": router_features(settings),
        "router": _shown_settings(settings),
        "control_state": control_state(pool),
        "replica_states": [pool.snapshot(r) for r in replicas],
    }


def router_features(settings: RouterSettings) -> dict[str, Any]:
    """What this router adds to the model's features (``features``, from a serving
    replica's model_info; null until one serves)."""
    return {
        "streaming": True,
        "cancellation": True,
        "request_ids": True,
        "max_upload_bytes": settings.max_upload_bytes,
        "max_partial_images": pv.MAX_PARTIAL_IMAGES,
        "response_formats": (
            ["b64_json", "url"] if settings.output_dir or settings.output_s3 else ["b64_json"]
        ),
        # Every field each image route takes (what the model takes: ``features``).
        "request_fields": request_fields(),
    }


def control_state(pool: ReplicaPool) -> dict[str, Any] | None:
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


def model_name(pool: ReplicaPool, settings: RouterSettings) -> str:
    """The name /v1/models lists, a placeholder until a replica has said."""
    return deps.served_name(pool, settings) or UNKNOWN


def _layout(info: ModelInfo | None, replicas: int) -> str | None:
    """The deployment's layout: each replica's gang, with dp = the number of replicas."""
    if info is None:
        return None
    gang = msgspec.structs.asdict(info.parallel)
    return describe(ParallelConfig(**gang, dp=max(replicas, 1)))


def _shown_settings(settings: RouterSettings) -> dict[str, Any]:
    """The settings /server_info shows: no path of this host, no secret."""
    hidden = {"output_dir", "api_keys", "admin_keys"}
    shown = {k: v for k, v in asdict(settings).items() if k not in hidden}
    shown["auth"] = {"api_keys": len(settings.api_keys), "admin_keys": len(settings.admin_keys)}
    shown["pool"]["wire_key"] = "curve" if settings.pool.wire_key is not None else None
    return shown


def router() -> APIRouter:
    api = APIRouter()
    api.get("/v1/models")(models)
    api.get(
        "/v1/models/{model_id:path}",
        responses={404: {"model": ErrorResponse, "description": "not the served model"}},
    )(model)
    api.get("/model_info")(model_info)
    api.get("/server_info")(server_info)
    return api
