"""What a router is started with (the CLI and ``serve`` build it; the app only reads it)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from dpserve import video
from dpserve.router.pool import PoolSettings
from dpserve.router.realtime_ws import RealtimeSettings


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
    # An edit's multipart form (its images and mask), read whole within body_timeout_s.
    max_upload_bytes: int = 64 << 20
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
    # How often this router polls each video job it placed (dpserve/router/videos.py):
    # how soon it sees one finish, and re-runs one whose replica was lost.
    video_poll_s: float = 1.0
    # The longest a video job may run: one estimated past it is a 400, one that runs
    # past it is stopped (dpserve/router/videos.py, docs/video.md).
    video_max_estimate_s: float = video.DEFAULT_MAX_ESTIMATE_S
