"""What route handlers depend on, reached through FastAPI's ``Depends`` from ``app.state``.

Every dependency is ``async def``: FastAPI runs a plain ``def`` dependency in a worker
thread, a thread hop per dependency per request for what is an attribute read.

``create_app`` sets the settings and the output store; the lifespan sets
:class:`Running` (the pool, the service, the sessions, the request registry, the video
jobs) while the app runs. Nothing here is module state: every app has its own.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated

from fastapi import Depends
from starlette.requests import HTTPConnection

from dpserve.contract import validation as pv
from dpserve.contract.model_info import Features, ModelInfo
from dpserve.router import served_model
from dpserve.router.bucket import BucketStore
from dpserve.router.metrics import RouterMetrics
from dpserve.router.pool import ReplicaPool
from dpserve.router.registry import Registry
from dpserve.router.request_ids import of_scope
from dpserve.router.service import RouterService
from dpserve.router.sessions import SessionRouter
from dpserve.router.settings import RouterSettings
from dpserve.router.store import OutputStore
from dpserve.router.videos import VideoJobs


@dataclass(frozen=True)
class Running:
    """What the lifespan opened; routes reach it only while the app runs."""

    pool: ReplicaPool
    service: RouterService
    sessions: SessionRouter
    registry: Registry
    videos: VideoJobs


async def running(conn: HTTPConnection) -> Running:
    found: Running | None = getattr(conn.app.state, "running", None)
    assert found is not None, "used outside the app's lifespan"
    return found


async def settings(conn: HTTPConnection) -> RouterSettings:
    found: RouterSettings = conn.app.state.settings
    return found


# Where url images go: a folder this router serves, or a bucket it presigns links into.
ImageStore = OutputStore | BucketStore


async def store(conn: HTTPConnection) -> ImageStore | None:
    found: ImageStore | None = conn.app.state.store
    return found


async def metrics(conn: HTTPConnection) -> RouterMetrics:
    found: RouterMetrics = conn.app.state.metrics
    return found


async def request_id(conn: HTTPConnection) -> str:
    """This request's id (dpserve/router/request_ids.py)."""
    return of_scope(conn.scope)


async def pool(state: Annotated[Running, Depends(running)]) -> ReplicaPool:
    return state.pool


async def service(state: Annotated[Running, Depends(running)]) -> RouterService:
    return state.service


async def registry(state: Annotated[Running, Depends(running)]) -> Registry:
    return state.registry


async def videos(state: Annotated[Running, Depends(running)]) -> VideoJobs:
    return state.videos


RunningDep = Annotated[Running, Depends(running)]
PoolDep = Annotated[ReplicaPool, Depends(pool)]
ServiceDep = Annotated[RouterService, Depends(service)]
RegistryDep = Annotated[Registry, Depends(registry)]
VideosDep = Annotated[VideoJobs, Depends(videos)]
SettingsDep = Annotated[RouterSettings, Depends(settings)]
StoreDep = Annotated["ImageStore | None", Depends(store)]
MetricsDep = Annotated[RouterMetrics, Depends(metrics)]
RequestIdDep = Annotated[str, Depends(request_id)]


def model_info(pool: ReplicaPool) -> ModelInfo | None:
    """A serving replica's model_info (every replica serves the same model)."""
    return next((r.info for r in pool.serving() if r.info is not None), None)


def served_name(pool: ReplicaPool, settings: RouterSettings) -> str | None:
    """The served model's name (dpserve/router/served_model.py); None: not known yet."""
    infos = (r.info for r in pool.replicas.values() if r.info is not None)
    return served_model.served_name(settings.served_model_name, infos)


def features(pool: ReplicaPool) -> Features | None:
    """The serving replicas' features (None: none has said; the replica checks anyway)."""
    info = model_info(pool)
    return info.features if info is not None else None


def limits(pool: ReplicaPool) -> pv.Limits:
    """The bounds the replicas check (a video model's frames included), once one has
    told us; until then the defaults, and frames are left to the replica (``max_frames``
    0: not checked here)."""
    info = model_info(pool)
    return info.limits() if info is not None else pv.Limits()
