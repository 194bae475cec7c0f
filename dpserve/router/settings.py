"""What a router is started with (the CLI and ``serve`` build it; the app only reads it).

The options a command line sets are ``RouterConfig``'s (``dpserve.config.router``):
their defaults here are its own, and ``RouterSettings.from_config`` maps one onto
these settings.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from dpserve.config.router import RouterConfig
from dpserve.config.router import default as option
from dpserve.router.pool import PoolSettings
from dpserve.router.realtime_ws import RealtimeSettings

if TYPE_CHECKING:
    from dpserve.plumbing.curve import WireKey
    from dpserve.router.tenants import TenantKey
    from dpserve.router.webhooks import WebhookSettings
    from dpserve.sources.uri import S3Source


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
    max_body_bytes: int = option("max_body")
    max_upload_bytes: int = option("max_upload_bytes")
    output_dir: Path | None = None  # a local output store (--output-dir, or a folder)
    output_s3: S3Source | None = None  # a bucket output store (docs/outputs.md)
    public_url: str = f"http://{option('host')}:{option('port')}"
    served_model_name: str | None = None
    # Bare keys are their own tenants (dpserve/router/tenants.py).
    api_keys: tuple[str | TenantKey, ...] = field(default=(), repr=False)
    admin_keys: tuple[str | TenantKey, ...] = field(default=(), repr=False)  # see all tenants
    body_timeout_s: float = option("body_timeout")
    max_connections: int = option("max_connections")
    max_connections_per_peer: int = option("max_connections_per_peer")
    header_timeout_s: float = option("header_timeout")
    # Host names answered besides loopback names and IP literals (dpserve/router/hosts.py).
    allowed_hosts: tuple[str, ...] = option("allowed_host")
    backlog: int = option("backlog")
    output_max_files: int = option("output_max_files")
    output_max_age_s: float = option("output_max_age")
    output_url_ttl_s: int = option("output_url_ttl")
    video_poll_s: float = option("video_poll")
    video_max_estimate_s: float = option("video_max_estimate")
    webhook: WebhookSettings | None = None  # None: no events are sent

    @property
    def fleet(self) -> str:
        """The replicas this router serves, as job records name them: routers of one
        service take over each other's video jobs, never another service's that
        shares the bucket (dpserve/router/leases.py)."""
        if self.kubernetes is not None:
            return f"k8s:{self.kubernetes.namespace}/{self.kubernetes.service}"
        joined = "\n".join(sorted(self.workers)).encode()
        return f"workers:{hashlib.sha256(joined).hexdigest()[:16]}"

    def check(self) -> None:
        """What no single flag can check: weights name configured tenants (ValueError)."""
        from dpserve.router.fair import check_weights
        from dpserve.router.tenants import tenant_key

        tenants = {tenant_key(k).tenant for k in (*self.api_keys, *self.admin_keys)}
        check_weights(self.pool.tenant_weights, tenants)

    @classmethod
    def from_config(cls, config: RouterConfig, wire_key: WireKey | None) -> RouterSettings:
        """The settings of a parsed command line, whose wire key file the caller read.

        Its ``discovery`` options are left to the caller, which checks them first.
        A webhook URL without its secret file, or the other way round, is a ValueError;
        so are both --output-dir and --output-store.
        """
        store, output_dir = config.output_store, config.output_dir
        if store is not None and output_dir is not None:
            raise ValueError(
                "give --output-store or --output-dir, not both (--output-dir PATH is "
                "--output-store PATH)"
            )
        local = store if isinstance(store, Path) else output_dir
        pool = PoolSettings(
            request_timeout_s=config.request_timeout,
            max_inflight=config.max_inflight_per_replica,
            policy=config.policy,
            adapter_routing=config.adapter_routing,
            adapter_home_slack=config.adapter_home_slack,
            loras=config.loras,
            max_queue=config.max_waiting,
            max_per_tenant=config.max_requests_per_tenant,
            tenant_weights=config.tenant_weights,
            wire_key=wire_key,
        )
        return cls(
            workers=config.worker,
            pool=pool,
            output_dir=local,
            output_s3=None if store is None or isinstance(store, Path) else store,
            public_url=config.public_url or f"http://{config.host}:{config.port}",
            served_model_name=config.served_model_name,
            api_keys=config.api_keys,
            admin_keys=config.admin_keys,
            body_timeout_s=config.body_timeout,
            max_body_bytes=config.max_body,
            max_upload_bytes=config.max_upload_bytes,
            max_connections=config.max_connections,
            max_connections_per_peer=config.max_connections_per_peer,
            header_timeout_s=config.header_timeout,
            allowed_hosts=config.allowed_host,
            backlog=config.backlog,
            output_max_files=config.output_max_files,
            output_max_age_s=config.output_max_age,
            output_url_ttl_s=config.output_url_ttl,
            video_poll_s=config.video_poll,
            video_max_estimate_s=config.video_max_estimate,
            webhook=_webhook(config),
        )


def _webhook(config: RouterConfig) -> WebhookSettings | None:
    url, key = config.webhook_url, config.webhook_secret_file
    if url is None and key is None:
        return None
    if url is None or key is None:
        given, missing = (
            ("--webhook-url", "--webhook-secret-file")
            if key is None
            else ("--webhook-secret-file", "--webhook-url")
        )
        raise ValueError(f"{given} needs {missing}: events are sent signed, to one URL")
    from dpserve.router.webhooks import WebhookSettings

    return WebhookSettings(url, key, retry_for_s=config.webhook_retry_for)
