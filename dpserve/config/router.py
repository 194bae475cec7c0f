"""What a router is started with: every option of ``dpserve router``, spelled once.

``RouterConfig`` is to the router what ``WorkerConfig`` is to the worker: each
field is a flag, with its help, parser and default (``dpserve.config.flags.Flag``).
From it come the argparse of ``dpserve router`` and of ``serve``'s router
(``add_router_args``), the config a parsed command line gives
(``RouterConfig.from_args``; ``dpserve.router.settings`` turns it into the
settings the app reads, whose defaults are these), the flags the operator passes
its router pods (``router_flags``) and the CRD's defaults that mirror the
router's (``default``). A ``serve=False`` option belongs to ``dpserve router``
alone: where its replicas are and its wire key (``serve`` makes both itself).

Stdlib only. The parsers of keys and the served name check with the router's own
rules, imported when a command line is parsed: the operator, which imports this
module for names and defaults, never loads the router.
"""

from __future__ import annotations

import argparse
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, get_args

from dpserve.config import flags
from dpserve.config.flags import flag, non_negative, port_number, positive, seconds

if TYPE_CHECKING:
    from dpserve.router.tenants import TenantKey
    from dpserve.sources.uri import S3Source

Discovery = Literal["static", "kubernetes"]
# The routing policies (dpserve.router.policies, docs/router.md, Routing policies).
PolicyName = Literal["round_robin", "least_work"]
# Whether least-work counts the load of adapters a replica lacks (docs/lora.md):
# blind is the comparison and the escape hatch.
AdapterRouting = Literal["aware", "blind"]


def parse_key(value: str) -> str:
    from dpserve.router.auth import check_key

    try:
        return check_key(value, "key")
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None  # the message names no key


def parse_key_file(value: str) -> tuple[TenantKey, ...]:
    """The keys of a file, read while parsing: a bad file fails the start at once."""
    from dpserve.router.auth import load_key_file

    try:
        return load_key_file(Path(value))
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def parse_output_store(value: str) -> S3Source | Path:
    from dpserve.router.bucket import parse_output_store as parse

    try:
        return parse(value)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def parse_url_ttl(value: str) -> int:
    from dpserve.router.bucket import MAX_URL_TTL_S

    ttl = positive(value)
    if ttl > MAX_URL_TTL_S:
        raise argparse.ArgumentTypeError(
            f"{ttl} s: a presigned link lives at most {MAX_URL_TTL_S} s (seven days)"
        )
    return ttl


def parse_served_name(value: str) -> str:
    from dpserve.router.served_model import check_name

    try:
        return check_name(value)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def parse_webhook_url(value: str) -> str:
    from dpserve.router.webhooks import check_url

    try:
        return check_url(value)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def parse_webhook_secret_file(value: str) -> bytes:
    """The signing key of a ``whsec_`` file, read while parsing: a bad one fails the start."""
    from dpserve.router.webhooks import load_secret

    try:
        return load_secret(Path(value))
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


@dataclass(frozen=True)
class TenantWeight:
    """``--tenant-weight NAME=W``: a tenant's weight in the fair order (docs/tenants.md)."""

    tenant: str
    weight: int

    def __str__(self) -> str:
        return f"{self.tenant}={self.weight}"


def parse_tenant_weight(value: str) -> TenantWeight:
    from dpserve.router.tenants import check_tenant

    name, sep, weight = value.partition("=")
    try:
        if not sep:
            raise ValueError(f"{value!r} is not NAME=WEIGHT")
        number = int(weight)
        if not 1 <= number <= 1000:
            raise ValueError(f"{value!r}: a weight is a whole number in 1..1000")
        return TenantWeight(check_tenant(name, f"--tenant-weight {value!r}"), number)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


@dataclass(frozen=True)
class LoraName:
    """``--lora NAME=PATH``: an adapter requests may name alone (docs/lora.md, Names)."""

    name: str
    path: str

    def __str__(self) -> str:
        return f"{self.name}={self.path}"


MAX_HOME_SLACK = 16.0  # requests: past it, the home takes whatever its cap allows


def parse_home_slack(value: str) -> float:
    slack = float(value)
    if not 0.0 <= slack <= MAX_HOME_SLACK:  # NaN fails too
        raise argparse.ArgumentTypeError(
            f"must be a number of requests in 0..{MAX_HOME_SLACK:g}, got {value}"
        )
    return slack


def parse_lora_name(value: str) -> LoraName:
    """``NAME=PATH`` with a name of the shape a request's adapter has."""
    from dpserve.contract.validation import LORA_NAME_RE, MAX_LORA_PATH_CHARS

    name, sep, path = value.partition("=")
    if not sep or not path:
        raise argparse.ArgumentTypeError(f"{value!r} is not NAME=PATH")
    if not LORA_NAME_RE.match(name):
        raise argparse.ArgumentTypeError(
            f"{name[:70]!r}: an adapter's name is 1-64 letters, digits, '.', '_' or '-', "
            "starting with a letter or digit"
        )
    if len(path) > MAX_LORA_PATH_CHARS:
        raise argparse.ArgumentTypeError(f"{name}'s path is over {MAX_LORA_PATH_CHARS} characters")
    return LoraName(name, path)


_KEYS = "Bearer key for %s routes (repeatable; visible in ps: prefer the file)"
_KEY_FILES = (
    "file of %s keys, one a line, alone or after its tenant's name (blank lines and # "
    "comments skipped; repeatable)"
)


@dataclass(frozen=True)
class RouterConfig:
    # Where the replicas are, and the wire to them: ``dpserve router``'s alone.
    worker: tuple[str, ...] = field(
        default=(),
        metadata=flag("replica driver tcp://HOST:PORT", serve=False, many=True),
    )
    discovery: Discovery = field(
        default="static",
        metadata=flag(
            "static: the --worker endpoints; kubernetes: a headless Service's ready endpoints",
            choices=get_args(Discovery),
            serve=False,
        ),
    )
    namespace: str | None = field(
        default=None,
        metadata=flag("kubernetes: namespace of the replicas' Service", serve=False),
    )
    service: str | None = field(
        default=None, metadata=flag("kubernetes: the replicas' headless Service", serve=False)
    )
    control_state_configmap: str | None = field(
        default=None,
        metadata=flag(
            "kubernetes: ConfigMap holding the desired control state (the operator makes it)",
            serve=False,
        ),
    )
    # ``serve`` has its own --wire-key-file: the key it hands its replicas and router.
    wire_key_file: Path | None = field(
        default=None,
        metadata=flag(
            "the replicas' wire key (z85 CURVE secret); without one the wire is plaintext",
            Path,
            serve=False,
        ),
    )
    # The HTTP front, ``serve``'s router too.
    host: str = field(default="127.0.0.1", metadata=flag("HTTP address (0.0.0.0: all)"))
    port: int = field(default=8000, metadata=flag("HTTP port", port_number))
    request_timeout: float = field(default=300.0, metadata=flag("seconds per request", float))
    # Per replica, times its batch size (its --max-batch, from its pings): one running
    # batch and one queued keeps a gang busy.
    max_inflight_per_replica: int = field(
        default=2,
        metadata=flag(
            "requests per replica at once, times its --max-batch; then they wait in the router",
            positive,
        ),
    )
    policy: PolicyName = field(
        default="least_work",
        metadata=flag(
            "where a generation goes: the replica with the least estimated work, or in turn",
            choices=get_args(PolicyName),
        ),
    )
    adapter_routing: AdapterRouting = field(
        default="aware",
        metadata=flag(
            "least_work: aware counts the load of LoRA adapters a replica lacks, so one "
            "adapter's requests gather where it is resident; blind ignores it (for comparison)",
            choices=get_args(AdapterRouting),
        ),
    )
    # How far least work detours a request to its adapters' home (docs/lora.md): loads
    # saved against the latency of the deeper queue there.
    adapter_home_slack: float = field(
        default=1.5,
        metadata=flag(
            "least_work, aware: the home replica of a request's LoRA adapters takes it when "
            "it finishes there within this many requests of the best replica; more saves "
            "adapter loads, less keeps latency (0: no detour)",
            parse_home_slack,
        ),
    )
    # Adapters requests may name alone (docs/lora.md, Names): the router sends the path.
    lora: tuple[LoraName, ...] = field(
        default=(),
        metadata=flag(
            "NAME=PATH: a LoRA adapter requests may name alone (repeatable)",
            parse_lora_name,
            many=True,
        ),
    )
    max_waiting: int = field(  # router-wide
        default=256, metadata=flag("queued requests, then 429", positive)
    )
    # Fair shares between tenants (docs/tenants.md): a cap per tenant on this router's
    # requests in flight and waiting, and weights in the order waiters are served.
    max_requests_per_tenant: int = field(
        default=0,
        metadata=flag(
            "requests one tenant may have in flight and waiting at this router, then 429; "
            "0: no cap",
            non_negative,
        ),
    )
    tenant_weight: tuple[TenantWeight, ...] = field(
        default=(),
        metadata=flag(
            "NAME=W: tenant NAME (a key file's) gets W shares of the replicas when they are "
            "contended (default 1; repeatable)",
            parse_tenant_weight,
            many=True,
        ),
    )
    output_dir: Path | None = field(
        default=None, metadata=flag("enables response_format=url", Path)
    )
    # Where url images go (docs/outputs.md): a bucket any router pod presigns links
    # into, or a local folder (what --output-dir names).
    output_store: S3Source | Path | None = field(
        default=None,
        metadata=flag(
            "enables response_format=url: s3://BUCKET/PREFIX (presigned links; AWS_* "
            "variables configure the client), or a folder (file:///PATH or PATH) as "
            "--output-dir",
            parse_output_store,
        ),
    )
    public_url: str | None = field(  # None: http://HOST:PORT
        default=None, metadata=flag("base of image URLs (default: own address)")
    )
    served_model_name: str | None = field(  # None: the model folder's name
        default=None,
        metadata=flag(
            "the model's name in /v1/models and in requests' model (another is a 404); "
            "default: the model folder's name",
            parse_served_name,
        ),
    )
    # The HTTP server's edges (docs/router.md, "Limits"): connections (WebSockets
    # included) past max_connections get 503 at once; the kernel queues backlog more.
    max_connections: int = field(
        default=1000,
        metadata=flag("open HTTP connections (WebSockets too), then 503", positive),
    )
    # One address may hold this many; behind a proxy every client shares its address
    # (docs/router.md, "Limits": raise it there, or 0 for no cap).
    max_connections_per_peer: int = field(
        default=256,
        metadata=flag(
            "connections one client address (IPv6: its /64) may hold busy, then 429; 0: no cap",
            non_negative,
        ),
    )
    # A connection that sends no complete request head in time is closed: silent
    # sockets hold no slot for long (docs/router.md, "Limits").
    header_timeout: float = field(
        default=10.0,
        metadata=flag(
            "seconds for a request head to arrive after connecting or after an answer",
            seconds,
        ),
    )
    backlog: int = field(default=2048, metadata=flag("TCP accept queue length", positive))
    # Host names answered besides localhost and IP literals, against DNS rebinding
    # (docs/router.md, "Security"; dpserve/router/hosts.py).
    allowed_host: tuple[str, ...] = field(
        default=(),
        metadata=flag(
            "a Host name this router answers to, besides localhost and IP addresses "
            "(repeatable; '*': any)",
            many=True,
        ),
    )
    # response_format=url files: the oldest go past either bound (docs/router.md).
    output_max_files: int = field(
        default=1000, metadata=flag("response_format=url files kept", positive)
    )
    output_max_age: float = field(
        default=3600.0, metadata=flag("seconds a url image is kept", seconds)
    )
    output_url_ttl: int = field(
        default=3600,
        metadata=flag(
            "seconds a url answer's link is good for (a folder's files live the shorter "
            "of this and --output-max-age)",
            parse_url_ttl,
        ),
    )
    # How often the router polls each video job it placed (dpserve/router/videos.py):
    # how soon it sees one finish, and re-runs one whose replica was lost.
    video_poll: float = field(
        default=1.0,
        metadata=flag(
            "seconds between looks at each video job this router placed (re-runs lost ones)",
            seconds,
        ),
    )
    # The longest a video job may hold a replica, in seconds of run time (docs/video.md,
    # "How long a job may run"). Half an hour: six image request timeouts.
    video_max_estimate: float = field(
        default=1800.0,
        metadata=flag(
            "seconds a video job may run: one estimated longer is a 400, one that runs "
            "longer is stopped",
            seconds,
        ),
    )
    # Video job events (docs/webhooks.md): the URL is configuration only, never a
    # request's; the secret file's key is read while parsing.
    webhook_url: str | None = field(
        default=None,
        metadata=flag(
            "POST video.completed and video.failed events here, signed (Standard Webhooks); "
            "needs --webhook-secret-file",
            parse_webhook_url,
        ),
    )
    webhook_secret_file: bytes | None = field(
        default=None,
        repr=False,
        metadata=flag(
            "file holding the webhook signing secret, one line whsec_<base64>",
            parse_webhook_secret_file,
        ),
    )
    webhook_retry_for: float = field(
        default=3600.0,
        metadata=flag(
            "seconds an undelivered webhook event is retried (waits doubling up to 60 s)",
            seconds,
        ),
    )
    max_body: int = field(default=1 << 20, metadata=flag("body bytes, then 413", positive))
    # An edit's multipart form (its images and mask), read whole within body_timeout.
    max_upload_bytes: int = field(
        default=64 << 20,
        metadata=flag("an edit's multipart body (images and mask), then 413", positive),
    )
    body_timeout: float = field(  # a body not fully read by then is refused
        default=30.0, metadata=flag("seconds to receive a body, then 408", seconds)
    )
    # Bearer keys (docs/router.md, "Security"): none configured, every route is open.
    # Admin keys work on inference routes too. A key file's keys are read while parsing.
    api_key: tuple[str, ...] = field(
        default=(), repr=False, metadata=flag(_KEYS % "inference", parse_key, many=True)
    )
    admin_key: tuple[str, ...] = field(
        default=(), repr=False, metadata=flag(_KEYS % "all", parse_key, many=True)
    )
    api_key_file: tuple[tuple[TenantKey, ...], ...] = field(
        default=(), repr=False, metadata=flag(_KEY_FILES % "api", parse_key_file, many=True)
    )
    admin_key_file: tuple[tuple[TenantKey, ...], ...] = field(
        default=(), repr=False, metadata=flag(_KEY_FILES % "admin", parse_key_file, many=True)
    )

    @classmethod
    def from_args(cls, args: argparse.Namespace, serve: bool = False) -> RouterConfig:
        """The config a ``dpserve router`` command line gives, or with ``serve`` the part
        a ``dpserve serve`` one sets (``add_router_args``; the rest keep their defaults)."""
        return cls(**flags.from_args(cls, args, serve_only=serve))

    @property
    def api_keys(self) -> tuple[str | TenantKey, ...]:
        """The inference keys, given one by one and in files."""
        return (*self.api_key, *(k for keys in self.api_key_file for k in keys))

    @property
    def tenant_weights(self) -> dict[str, int]:
        """Each weighted tenant's weight (the last given wins)."""
        return {w.tenant: w.weight for w in self.tenant_weight}

    @property
    def loras(self) -> dict[str, str]:
        """The registered adapters, name -> path (the last given of a name wins)."""
        return {lora.name: lora.path for lora in self.lora}

    @property
    def admin_keys(self) -> tuple[str | TenantKey, ...]:
        return (*self.admin_key, *(k for keys in self.admin_key_file for k in keys))


def add_router_args(parser: argparse.ArgumentParser, serve: bool = False) -> None:
    """Every flag of ``dpserve router``, or with ``serve`` those ``serve``'s router takes."""
    flags.add_flags(parser, RouterConfig, serve_only=serve)


def router_flags(options: Mapping[str, object]) -> list[str]:
    """``dpserve router`` flags for some options, keyed by ``RouterConfig`` field name
    (a key file's option is its path); see ``flags.to_flags``."""
    return flags.to_flags(RouterConfig, "dpserve router", options)


def default(name: str) -> Any:
    """A ``RouterConfig`` field's default, for settings elsewhere that mirror it."""
    return flags.default_of(RouterConfig, name)
