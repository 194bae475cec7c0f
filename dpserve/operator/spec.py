"""The DiffusionService resource: the one source of truth for its CRD and the operator.

The CRD's OpenAPI schema is generated from these models (``dpserve.operator.crd``),
and the operator parses objects with them, so the two cannot drift. CEL rules
sit beside the fields they guard; they run in the apiserver. Defaults that mirror
a worker or router option (parallel degrees, threads, realtime limits; timeouts,
queue bounds, policy) are the process's own, read from ``WorkerConfig`` and
``RouterConfig`` (``dpserve.config``); ``builders.worker_options`` and
``builders.router_options`` map the fields onto them.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Final, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator
from pydantic.config import JsonDict

from dpserve.config.router import MAX_HOME_SLACK, AdapterRouting, PolicyName
from dpserve.config.router import default as router_default
from dpserve.config.worker import StepCacheKind
from dpserve.config.worker import default as worker_default
from dpserve.contract.validation import LORA_NAME_RE, MAX_LORA_PATH_CHARS

GROUP = "dpserve.dev"
VERSION = "v1alpha1"
KIND = "DiffusionService"
PLURAL = "diffusionservices"
SINGULAR = "diffusionservice"
SHORT_NAMES = ["dsvc"]

ROLE_MESSAGE = (
    "data-parallel replicas need role monolithic; scale disaggregated roles by adding role "
    "instances"
)
# The role field names the disaggregated shapes (an encoder, denoiser or decoder
# service each) that the CRD may one day run; no builder reads it, so a role other
# than monolithic would run as monolithic. It is refused instead.
ROLE_NOT_IMPLEMENTED = (
    "disaggregated roles (encoder, denoiser, decoder) are not implemented: role must be monolithic"
)


def cel(rule: str, message: str, field_path: str | None = None) -> JsonDict:
    out: JsonDict = {"rule": rule, "message": message}
    if field_path:
        out["fieldPath"] = field_path
    return out


def _whole(value: Any, option: str) -> int:
    if value != int(value):
        raise ValueError(f"{option} defaults to {value!r}, not a whole number")
    return int(value)


def _worker(name: str) -> int:
    """The default of a field that mirrors a ``WorkerConfig`` option: the worker's own
    (so the CRD and ``dpserve worker`` cannot disagree), a whole number here."""
    return _whole(worker_default(name), f"WorkerConfig.{name}")


def _router(name: str) -> int:
    """The default of a field that mirrors a ``RouterConfig`` option, a whole number."""
    return _whole(router_default(name), f"RouterConfig.{name}")


def _validations(*rules: JsonDict) -> JsonDict:
    return {"x-kubernetes-validations": list(rules)}


class _Model(BaseModel):
    # Unknown fields are an error in the operator too: the CRD prunes them, so
    # seeing one means the schema and the code disagree.
    model_config = ConfigDict(extra="forbid", populate_by_name=True)


_OBJECT: JsonDict = {"type": "object", "x-kubernetes-preserve-unknown-fields": True}


class PVCSource(_Model):
    claimName: str = Field(min_length=1, description="PersistentVolumeClaim holding the model")
    readOnly: bool = True


class HostPathSource(_Model):
    path: str = Field(min_length=1, description="folder on the node holding the model")


class ModelVolume(_Model):
    persistentVolumeClaim: PVCSource | None = None
    hostPath: HostPathSource | None = None


class ModelCredentials(_Model):
    secretName: str = Field(
        min_length=1,
        max_length=253,
        description="Secret in the service's namespace whose keys become the fill Job's "
        "environment: the store's own variables (AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, "
        "AWS_ENDPOINT_URL, AWS_REGION; HF_TOKEN, HF_ENDPOINT); never given to replicas",
    )


class NodeLocalCache(_Model):
    path: str = Field(
        min_length=2,
        max_length=4096,
        pattern=r"^/",
        description="folder on each node (a hostPath, made beforehand and writable by user "
        "10001) that the first replica scheduled there fetches the model into; the others "
        "there find it ready",
    )


CACHE_ONE_OF = (
    "model.cache needs exactly one of claimName (a claim filled once by a Job) or nodeLocal "
    "(a folder on each node, filled once per node by its first replica)"
)


class ModelCache(_Model):
    model_config = ConfigDict(
        json_schema_extra=_validations(
            cel("has(self.claimName) != has(self.nodeLocal)", CACHE_ONE_OF),
        )
    )

    claimName: str | None = Field(
        None,
        min_length=1,
        max_length=253,
        description="PersistentVolumeClaim the model is fetched into once, by one Job, and "
        "that every replica mounts read-only at model.mountPath (ReadWriteMany storage "
        "when replicas run on several nodes; writable by user 10001)",
    )
    nodeLocal: NodeLocalCache | None = Field(
        None,
        description="for clusters without shared storage: each replica's init container "
        "fetches the revision the operator pinned into this host folder, once per node, "
        "and the replica mounts it read-only (needs the operator's allowHostPathModels and "
        "a namespace whose Pod Security level allows hostPath)",
    )
    keep: int = Field(
        1,
        ge=0,
        le=100,
        description="entries kept after a roll besides the ones loaded, the newest first "
        "(1: the previous model, to roll back to); in a claim, entries any "
        "DiffusionService of this namespace loads are never removed; on a node, the init "
        "container keeps this many of the source's other entries",
    )


SOURCE_PATTERN: Final = r"^(hf|s3)://[^\s]+$"
SOURCE_XOR_PATH = (
    "model needs exactly one of path (a pipeline folder on a volume or in the image) or "
    "source (hf://ORG/NAME[@REVISION] or s3://BUCKET/PREFIX, fetched into model.cache)"
)
SOURCE_NEEDS_CACHE = (
    "model.source needs model.cache: claimName (a claim it is fetched into once for every "
    "replica) or nodeLocal (a folder on each node, fetched into once per node)"
)
SOURCE_NOT_VOLUME = (
    "model.volume is for a model already on a volume; with model.source the model is "
    "fetched into model.cache: give one or the other"
)
FETCH_ONLY = "model.cache and model.credentials go with model.source"


class ModelSource(_Model):
    model_config = ConfigDict(
        json_schema_extra=_validations(
            cel(
                "!has(self.volume) || (has(self.volume.persistentVolumeClaim) != "
                "has(self.volume.hostPath))",
                "model.volume needs exactly one of persistentVolumeClaim or hostPath",
            ),
            cel("has(self.path) != has(self.source)", SOURCE_XOR_PATH),
            cel("!has(self.source) || has(self.cache)", SOURCE_NEEDS_CACHE),
            cel("!has(self.source) || !has(self.volume)", SOURCE_NOT_VOLUME),
            cel("has(self.source) || (!has(self.cache) && !has(self.credentials))", FETCH_ONLY),
        )
    )

    path: str | None = Field(
        None,
        min_length=1,
        description="diffusers pipeline folder inside the pod (under mountPath when a volume "
        "is given; baked into the image otherwise)",
    )
    source: str | None = Field(
        None,
        max_length=1024,
        pattern=SOURCE_PATTERN,
        description="hf://ORG/NAME[@REVISION] or s3://BUCKET/PREFIX: fetched once into "
        "model.cache by a Job, verified, then loaded by every replica (docs/models.md)",
    )
    credentials: ModelCredentials | None = Field(
        None, description="the store's credentials and endpoint, from a Secret"
    )
    cache: ModelCache | None = Field(None, description="where model.source is fetched into")
    volume: ModelVolume | None = Field(None, description="where the model comes from")
    mountPath: str = Field(
        "/models",
        description="where the volume (or the cache claim) is mounted; the only folder "
        "weight and LoRA loads may read from (the worker's --allow-path)",
    )


class Parallelism(_Model):
    model_config = ConfigDict(
        json_schema_extra=_validations(
            cel(
                "(!has(self.ulysses) && !has(self.ring)) || "
                "(has(self.ulysses) ? self.ulysses : 1) * (has(self.ring) ? self.ring : 1) "
                "== self.sp",
                "parallelism.ulysses * parallelism.ring must equal parallelism.sp",
            )
        )
    )

    tp: int = Field(_worker("tp"), ge=1, le=64, description="tensor-parallel degree")
    sp: int = Field(
        _worker("sp"), ge=1, le=64, description="sequence-parallel degree (ulysses * ring)"
    )
    ulysses: int | None = Field(None, ge=1, le=64, description="Ulysses part of sp")
    ring: int | None = Field(None, ge=1, le=64, description="ring-attention part of sp")
    cfg: int = Field(_worker("cfg"), ge=1, le=2, description="CFG-parallel degree: 1 or 2")

    @property
    def gang_size(self) -> int:
        return self.tp * self.sp * self.cfg


class StepCacheSpec(_Model):
    """The step cache requests that name none get (docs/worker.md, Step caching)."""

    model_config = ConfigDict(
        json_schema_extra=_validations(
            cel(
                "!has(self.threshold) || self.type == 'first_block_cache'",
                "stepCache.threshold is first_block_cache's knob",
            ),
            cel(
                "!has(self.interval) || self.type == 'taylorseer'",
                "stepCache.interval is taylorseer's knob",
            ),
        )
    )

    type: StepCacheKind
    threshold: float | None = Field(
        None, ge=0, le=1, description="first_block_cache: relative change that skips the rest"
    )
    interval: int | None = Field(
        None, ge=2, le=50, description="taylorseer: steps from one full computation to the next"
    )


class ServiceSpec(_Model):
    type: Literal["ClusterIP", "NodePort", "LoadBalancer"] = "ClusterIP"
    port: int = Field(80, ge=1, le=65535)


class RouterAuth(_Model):
    """API keys the router demands (docs/kubernetes.md, API keys)."""

    secretName: str = Field(
        min_length=1,
        max_length=253,
        description="Secret in the service's namespace with keys api-keys and admin-keys "
        "(one key per line); mounted into the router pods",
    )


class RouterWebhook(_Model):
    """Where the routers POST video job events (docs/webhooks.md), and their secret."""

    url: str = Field(
        min_length=1,
        max_length=2048,
        pattern=r"^https?://[^\s@#/?]+([/?][^\s#]*)?$",
        description="http(s) URL that receives video.completed and video.failed events "
        "(no user:password@, no #fragment)",
    )
    secretName: str = Field(
        min_length=1,
        max_length=253,
        description="Secret in the service's namespace whose key webhook-secret holds the "
        "signing secret, whsec_<base64> (Standard Webhooks); mounted into the router pods",
    )
    retryForSeconds: int = Field(
        _router("webhook_retry_for"),
        ge=1,
        le=7 * 86400,
        description="seconds an undelivered event is retried, waits doubling up to 60 s",
    )


class OutputCredentials(_Model):
    secretName: str = Field(
        min_length=1,
        max_length=253,
        description="Secret in the service's namespace whose keys become the router and "
        "replica pods' environment: the store's own variables (AWS_ACCESS_KEY_ID, "
        "AWS_SECRET_ACCESS_KEY, AWS_ENDPOINT_URL, AWS_REGION)",
    )


class OutputStore(_Model):
    """Where response_format=url images and finished videos go (docs/outputs.md): a
    bucket every router pod uploads images to and presigns links into, and every
    replica pod uploads its videos to."""

    uri: str = Field(
        min_length=6,
        max_length=1024,
        pattern=r"^s3://[a-z0-9][a-z0-9.-]{1,61}[a-z0-9](/[^\s]*)?$",
        description="s3://BUCKET/PREFIX on any S3-compatible store (AWS_ENDPOINT_URL in "
        "the credentials Secret for one other than AWS)",
    )
    urlTtlSeconds: int = Field(
        _router("output_url_ttl"),
        ge=1,
        le=7 * 24 * 3600,
        description="seconds a url answer's presigned link is good for",
    )
    credentials: OutputCredentials | None = Field(
        None,
        description="the store's credentials and endpoint, from a Secret (none: the pod's "
        "own, e.g. a workload identity)",
    )


# A tenant's name, as the router checks it (dpserve/router/tenants.py; the operator
# never imports the router).
TENANT_NAME: Final = re.compile(r"^[a-z0-9]([a-z0-9._-]{0,61}[a-z0-9])?$")

# A Host name (no port), or '*' for any (dpserve/router/hosts.py).
HostName = Annotated[str, Field(min_length=1, max_length=253, pattern=r"^(\*|[A-Za-z0-9_.-]+)$")]


class RouterSpec(_Model):
    replicas: int = Field(1, ge=0, le=100)
    service: ServiceSpec = Field(default_factory=ServiceSpec, json_schema_extra={"default": {}})
    image: str | None = Field(None, description="router image; the chart's default if omitted")
    requestTimeoutSeconds: int = Field(_router("request_timeout"), ge=1, le=86400)
    maxInflightPerReplica: int = Field(_router("max_inflight_per_replica"), ge=1, le=1024)
    maxWaiting: int = Field(_router("max_waiting"), ge=1, le=100000)
    policy: PolicyName = Field(
        router_default("policy"),
        description="where a generation goes: the replica with the least estimated work, "
        "or each in turn (docs/router.md, Routing policies)",
    )
    adapterRouting: AdapterRouting = Field(
        router_default("adapter_routing"),
        description="with policy least_work: aware counts the load of LoRA adapters a "
        "replica lacks, so one adapter's requests gather where it is resident; blind "
        "ignores it (for comparison; docs/lora.md)",
    )
    adapterHomeSlack: float = Field(
        router_default("adapter_home_slack"),
        ge=0,
        le=MAX_HOME_SLACK,
        description="with adapterRouting aware: the home replica of a request's LoRA "
        "adapters takes it when it finishes there within this many requests of the best "
        "replica; more saves adapter loads, less keeps latency (0: no detour; docs/lora.md)",
    )
    loras: dict[str, Annotated[str, Field(min_length=1, max_length=MAX_LORA_PATH_CHARS)]] = Field(
        default_factory=dict,
        max_length=256,
        description="LoRA adapters requests may name alone, name -> path (a folder the "
        "replicas may read, or a model source); the router sends the path on "
        "(docs/lora.md, Names)",
    )
    resources: dict[str, Any] | None = Field(None, json_schema_extra=_OBJECT)
    auth: RouterAuth | None = Field(
        None, description="API keys; without it the router serves anyone who reaches it"
    )
    servedModelName: str | None = Field(
        None,
        min_length=1,
        max_length=256,
        pattern=r"^[!-~]+$",  # served_model.check_name: printable ASCII, no spaces
        description="the model's name in /v1/models and in requests' model (another is a "
        "404); default: this resource's name",
    )
    maxConnectionsPerPeer: int = Field(
        _router("max_connections_per_peer"),
        ge=0,
        le=1_000_000,
        description="connections one client address may hold busy, then 429 (0: no cap); "
        "behind an Ingress or a proxy every client shares its address: raise it or set 0 "
        "(docs/router.md, Limits)",
    )
    allowedHosts: list[HostName] = Field(
        default_factory=list,
        max_length=64,
        description="Host names the router answers besides its Service's names, localhost "
        "and IP addresses (an Ingress's host, say; '*': any); others get 421, against DNS "
        "rebinding (docs/router.md, Security)",
    )
    maxRequestsPerTenant: int = Field(
        _router("max_requests_per_tenant"),
        ge=0,
        le=1_000_000,
        description="requests one tenant (a key, or a name in the keys Secret) may have in "
        "flight and waiting at each router pod, then 429; 0: no cap (docs/tenants.md, "
        "Fair shares)",
    )
    tenantWeights: dict[str, Annotated[int, Field(ge=1, le=1000)]] = Field(
        default_factory=dict,
        max_length=256,
        description="shares of the replicas each named tenant gets when they are contended "
        "(others weigh 1); every name must be a tenant of the keys Secret, or the router "
        "does not start (docs/tenants.md, Fair shares)",
    )

    @field_validator("tenantWeights")
    @classmethod
    def _tenant_names(cls, weights: dict[str, int]) -> dict[str, int]:
        # Not a CEL rule: a regex over map keys of unbounded length exceeds the API
        # server's cost budget; the operator refuses the spec instead (a condition).
        for name in weights:
            if not TENANT_NAME.match(name):
                raise ValueError(
                    f"spec.router.tenantWeights: {name[:64]!r} is no tenant name (1-63 "
                    "lowercase letters, digits, '.', '_' or '-', starting and ending with a "
                    "letter or digit)"
                )
        return weights

    @field_validator("loras")
    @classmethod
    def _lora_names(cls, loras: dict[str, str]) -> dict[str, str]:
        # As tenantWeights': a regex over map keys is the operator's check, not CEL's.
        for name in loras:
            if not LORA_NAME_RE.match(name):
                raise ValueError(
                    f"spec.router.loras: {name[:70]!r} is no adapter name (1-64 letters, "
                    "digits, '.', '_' or '-', starting with a letter or digit)"
                )
        return loras

    webhook: RouterWebhook | None = Field(
        None, description="video job events, signed, to one URL (docs/webhooks.md)"
    )
    outputStore: OutputStore | None = Field(
        None,
        description="enables response_format=url (images go to a bucket as presigned "
        "links); replicas upload finished videos there too",
    )
    videoMaxEstimateSeconds: int = Field(
        _router("video_max_estimate"),
        ge=1,
        le=7 * 86400,
        description="seconds a video job may run: one estimated longer is refused (400), one "
        "that runs longer is stopped (docs/video.md)",
    )


class UpdateStrategy(_Model):
    model_config = ConfigDict(
        json_schema_extra=_validations(
            cel(
                "self.maxUnavailable > 0 || self.maxSurge > 0",
                "updateStrategy needs maxUnavailable > 0 or maxSurge > 0 to make progress",
            )
        )
    )

    maxUnavailable: int = Field(1, ge=0, description="replicas that may be down during a roll")
    maxSurge: int = Field(0, ge=0, description="extra replicas (and their GPUs) during a roll")


HOSTNAME_KEY: Final = "kubernetes.io/hostname"
MIN_DOMAINS_MESSAGE: Final = "minDomains needs whenUnsatisfiable DoNotSchedule"


class TopologySpreadConstraint(_Model):
    """A spread constraint of the replica pods; labelSelector is the operator's."""

    model_config = ConfigDict(
        json_schema_extra=_validations(
            cel(
                "!has(self.minDomains) || self.whenUnsatisfiable == 'DoNotSchedule'",
                MIN_DOMAINS_MESSAGE,
            )
        )
    )

    topologyKey: str = Field(
        min_length=1,
        max_length=316,
        description="node label whose values are the domains (kubernetes.io/hostname: "
        "nodes; topology.kubernetes.io/zone: zones)",
    )
    maxSkew: int = Field(
        1, ge=1, le=1000, description="most replicas one domain may have beyond the emptiest"
    )
    whenUnsatisfiable: Literal["ScheduleAnyway", "DoNotSchedule"] = Field(
        "ScheduleAnyway",
        description="ScheduleAnyway: a preference; DoNotSchedule: a replica stays Pending "
        "(the scheduler's message in status) rather than break the skew",
    )
    minDomains: int | None = Field(
        None, ge=1, le=1000, description="with DoNotSchedule: domains counted even when empty"
    )


DEFAULT_SPREAD: Final = (TopologySpreadConstraint(topologyKey=HOSTNAME_KEY),)
PRIORITY_CLASS_PATTERN: Final = r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$"


class RealtimeSpec(_Model):
    """Realtime sessions each replica holds (docs/realtime.md)."""

    maxSessions: int = Field(
        _worker("max_sessions"), ge=1, le=1024, description="sessions a replica holds at once"
    )
    maxSessionMB: int = Field(
        _worker("max_session_mb"), ge=1, le=1048576, description="state one session may take"
    )
    idleTimeoutSeconds: int = Field(
        _worker("session_idle_timeout_s"),
        ge=1,
        le=86400,
        description="a session nobody stepped for this long is released",
    )


class VideoJobsSpec(_Model):
    """Video jobs each replica runs and keeps (docs/video.md); finished videos live in the
    pod's scratch volume, so they go with the pod."""

    maxFrames: int = Field(
        _worker("max_frames"), ge=1, le=10000, description="most frames a video job makes"
    )
    ttlSeconds: int = Field(
        int(_worker("video_ttl_s")),
        ge=1,
        le=30 * 86400,
        description="seconds a finished video stays retrievable",
    )
    maxBytes: int = Field(
        _worker("video_max_bytes"),
        ge=1 << 20,
        description="bytes of finished videos a replica keeps; the oldest go first",
    )


class EnvVar(_Model):
    name: str = Field(min_length=1)
    value: str | None = None
    valueFrom: dict[str, Any] | None = Field(None, json_schema_extra=_OBJECT)


class DiffusionServiceSpec(_Model):
    model_config = ConfigDict(
        json_schema_extra=_validations(
            cel("self.role == 'monolithic' || self.replicas <= 1", ROLE_MESSAGE),
            cel("self.role == 'monolithic'", ROLE_NOT_IMPLEMENTED, ".role"),
        )
    )

    model: ModelSource
    replicas: int = Field(1, ge=0, le=1000, description="data-parallel replicas (pods)")
    # Object defaults are spelled out: the apiserver checks them against the
    # object's CEL rules without applying the nested defaults first.
    parallelism: Parallelism = Field(
        default_factory=Parallelism,
        json_schema_extra={"default": {k: _worker(k) for k in ("tp", "sp", "cfg")}},
    )
    role: Literal["monolithic", "encoder", "denoiser", "decoder"] = Field(
        "monolithic",
        description="monolithic: each replica runs the whole pipeline; the disaggregated "
        "roles are refused (not implemented)",
    )
    image: str | None = Field(None, description="worker image; the chart's default if omitted")
    device: Literal["cuda", "cpu"] = Field("cuda", description="cpu requests no GPUs")
    gpuResource: str = Field("nvidia.com/gpu", min_length=1)
    resources: dict[str, Any] | None = Field(None, json_schema_extra=_OBJECT)
    nodeSelector: dict[str, str] | None = None
    tolerations: list[dict[str, Any]] | None = Field(
        None, json_schema_extra={"type": "array", "items": dict(_OBJECT)}
    )
    affinity: dict[str, Any] | None = Field(None, json_schema_extra=_OBJECT)
    topologySpreadConstraints: list[TopologySpreadConstraint] | None = Field(
        None,
        max_length=8,
        description="how replica pods spread over nodes or zones (the pod field, with the "
        "labelSelector filled in); omitted: spread over nodes as a preference "
        "(kubernetes.io/hostname, maxSkew 1, ScheduleAnyway); [] turns spreading off",
    )
    onePerNode: bool = Field(
        False,
        description="at most one replica of this service per node (required pod "
        "anti-affinity on kubernetes.io/hostname): a replica that finds no free node stays "
        "Pending and status shows the scheduler's message",
    )
    priorityClassName: str | None = Field(
        None,
        min_length=1,
        max_length=253,
        pattern=PRIORITY_CLASS_PATTERN,
        description="PriorityClass of the replica pods (it must exist: the apiserver "
        "refuses the pods otherwise, and status says so)",
    )
    env: list[EnvVar] | None = None
    schedulerPort: int = Field(5575, ge=1024, le=65535)
    threadsPerRank: int = Field(_worker("threads_per_rank"), ge=1, le=256)
    maxSequenceLength: int | None = Field(None, ge=1, le=4096, description="text tokens")
    maxBatch: int = Field(
        _worker("max_batch"), ge=1, le=256, description="images one batched pipeline call holds"
    )
    batchWaitMs: int = Field(
        _worker("batch_wait_ms"),
        ge=0,
        le=10000,
        description="ms a partly filled batch waits for more compatible requests",
    )
    loraCacheMb: int = Field(
        _worker("lora_cache_mb"),
        ge=1,
        le=1 << 20,
        description="MiB of LoRA adapters requests named a replica keeps loaded (docs/lora.md)",
    )
    stepCache: StepCacheSpec | None = Field(
        None, description="the default step cache; requests may name another or none"
    )
    compile: bool = Field(False, description="torch.compile the denoiser (docs/worker.md)")
    compileSizes: list[str] = Field(
        default_factory=list,
        max_length=8,
        description='"WxH" sizes the warm-up compiles (none: the pipeline\'s default size)',
        json_schema_extra={"items": {"type": "string", "pattern": "^[0-9]{1,5}x[0-9]{1,5}$"}},
    )
    router: RouterSpec = Field(default_factory=RouterSpec, json_schema_extra={"default": {}})
    realtime: RealtimeSpec = Field(default_factory=RealtimeSpec, json_schema_extra={"default": {}})
    video: VideoJobsSpec = Field(default_factory=VideoJobsSpec, json_schema_extra={"default": {}})
    updateStrategy: UpdateStrategy = Field(
        default_factory=UpdateStrategy,
        json_schema_extra={"default": {"maxUnavailable": 1, "maxSurge": 0}},
    )


class Condition(_Model):
    type: str
    status: Literal["True", "False", "Unknown"]
    reason: str
    message: str
    observedGeneration: int | None = None
    lastTransitionTime: str


class ReplicaStatus(_Model):
    index: int
    pod: str
    phase: str = Field(
        description="the pod's phase, Terminating, Missing (being recreated), "
        "WaitingForModel (held until model.source is fetched) or FetchingModel (its init "
        "container fetches the model into its node's cache)"
    )
    ready: bool = Field(description="serves: pod Ready and no router reports it out of sync")
    updated: bool
    node: str | None = None
    reason: str | None = None
    message: str | None = None


class LoadedModel(_Model):
    """The cache entry the replicas load: fetched, verified and published."""

    source: str
    revision: str = Field(description="the hub's commit, or a digest of the S3 listing")
    path: str = Field(description="the pipeline folder inside the pods")
    claim: str | None = Field(None, description="the cache claim it lies on")
    nodeLocal: str | None = Field(
        None, description="the host folder of each node it is fetched into (model.cache.nodeLocal)"
    )
    bytes: int | None = None


class ModelFetch(_Model):
    """The fill of model.source while it is not loaded (node-local: the replicas' too)."""

    source: str
    job: str | None = Field(None, description="the fill (or pin) Job")
    pod: str | None = Field(None, description="node-local: the replica whose fetch is shown")
    state: Literal["Pending", "Fetching", "Failed"]
    revision: str | None = None
    bytesDone: int | None = None
    bytesTotal: int | None = None
    bytesPerSecond: int | None = None
    etaSeconds: int | None = None
    message: str | None = None


class ModelStatus(_Model):
    loaded: LoadedModel | None = None
    fetch: ModelFetch | None = None
    pruned: str | None = Field(
        None, description="the loaded folder after whose roll the cache was last pruned"
    )
    progress: str = Field("", description="one line for kubectl get: Ready, 41% …, Failed")


class DiffusionServiceStatus(_Model):
    replicas: int = 0
    readyReplicas: int = 0
    updatedReplicas: int = 0
    ready: str = Field("0/0", description="ready/desired, for kubectl get")
    parallel: str = Field("", description="gang layout, for kubectl get")
    selector: str = ""
    observedGeneration: int | None = None
    endpoint: str | None = None
    model: ModelStatus | None = Field(None, description="model.source's fetch (absent without one)")
    replicaStatuses: list[ReplicaStatus] = Field(default_factory=list)
    conditions: list[Condition] = Field(default_factory=list)
    wireSecret: str | None = Field(
        None, description="the wire key Secret the operator created for this service"
    )


NODE_LOCAL_REFUSED = (
    "model.cache.nodeLocal is not allowed by this operator (chart value allowHostPathModels "
    "is false): a node-local cache is a hostPath volume the replicas' init containers write "
    "to; use model.cache.claimName, or ask the cluster's admin to allow it"
)
HOST_PATH_REFUSED = (
    "model.volume.hostPath is not allowed by this operator (chart value "
    "allowHostPathModels is false; the restricted Pod Security Standard forbids hostPath "
    "volumes too): put the model on a persistentVolumeClaim"
)


def problems(spec: DiffusionServiceSpec, allow_host_path: bool = False) -> list[str]:
    """What is wrong with a spec that the apiserver admitted anyway.

    The CEL rules are mirrored here because Helm never upgrades a CRD: a cluster
    may run an older CRD without them. The model path rules and the hostPath
    policy are the operator's own (they need no cluster-side check to be reported
    in status).
    """
    found = []
    if spec.role != "monolithic" and spec.replicas > 1:
        found.append(ROLE_MESSAGE)
    if spec.role != "monolithic":
        found.append(ROLE_NOT_IMPLEMENTED)
    par = spec.parallelism
    if (par.ulysses is not None or par.ring is not None) and (par.ulysses or 1) * (
        par.ring or 1
    ) != par.sp:
        found.append("parallelism.ulysses * parallelism.ring must equal parallelism.sp")
    volume = spec.model.volume
    if volume is not None and (volume.persistentVolumeClaim is None) == (volume.hostPath is None):
        found.append("model.volume needs exactly one of persistentVolumeClaim or hostPath")
    if volume is not None and volume.hostPath is not None and not allow_host_path:
        found.append(HOST_PATH_REFUSED)
    cache = spec.model.cache
    if cache is not None and cache.nodeLocal is not None and not allow_host_path:
        found.append(NODE_LOCAL_REFUSED)
    if spec.updateStrategy.maxUnavailable == 0 and spec.updateStrategy.maxSurge == 0:
        found.append("updateStrategy needs maxUnavailable > 0 or maxSurge > 0 to make progress")
    for spread in spec.topologySpreadConstraints or ():
        if spread.minDomains is not None and spread.whenUnsatisfiable != "DoNotSchedule":
            found.append(MIN_DOMAINS_MESSAGE)
    found += _model_problems(spec.model)
    return found


def _model_problems(model: ModelSource) -> list[str]:
    found = []
    if (model.path is None) == (model.source is None):
        found.append(SOURCE_XOR_PATH)
    cache = model.cache
    if cache is not None and (cache.claimName is None) == (cache.nodeLocal is None):
        found.append(CACHE_ONE_OF)
    if (
        cache is not None
        and cache.nodeLocal is not None
        and not cache.nodeLocal.path.startswith("/")
    ):
        found.append(f"model.cache.nodeLocal.path must be absolute, got {cache.nodeLocal.path!r}")
    if model.source is not None:
        if model.cache is None:
            found.append(SOURCE_NEEDS_CACHE)
        if model.volume is not None:
            found.append(SOURCE_NOT_VOLUME)
        problem = source_problem(model.source)
        if problem:
            found.append(f"model.source: {problem}")
    elif model.cache is not None or model.credentials is not None:
        found.append(FETCH_ONLY)
    if not model.mountPath.startswith("/"):
        found.append(f"model.mountPath must be absolute, got {model.mountPath!r}")
    if model.path is None:
        return found
    if not model.path.startswith("/"):
        found.append(f"model.path must be absolute inside the pod, got {model.path!r}")
    elif model.volume is not None and not model.path.startswith(model.mountPath):
        found.append(
            f"model.path {model.path!r} is not under model.mountPath "
            f"{model.mountPath!r}, where the volume is mounted"
        )
    return found


def source_problem(uri: str) -> str | None:
    """What ``dpserve fetch`` would refuse in ``uri`` (the same parser), or None."""
    from dpserve.sources.errors import SourceError
    from dpserve.sources.uri import LocalSource, parse

    try:
        parsed = parse(uri)
    except SourceError as exc:
        return str(exc)
    if isinstance(parsed, LocalSource):
        return f"{uri!r} is a folder, not hf:// or s3://: give it as model.path"
    return None
