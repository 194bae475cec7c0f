"""Pure manifest builders: a DiffusionService in, Kubernetes objects (dicts) out.

Nothing here talks to the API; each builder is a function of its inputs, so each
is tested against an expected manifest. Child names are deterministic and every
child carries an owner reference to the CR, so deleting the CR deletes them.
"""

from __future__ import annotations

import copy
import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any, Final

from dpserve.config.router import router_flags
from dpserve.config.worker import worker_flags
from dpserve.operator import spec as s

ROUTER_PORT: Final = 8000
SPEC_HASH: Final = "dpserve.dev/spec-hash"
REPLICA_LABEL: Final = "dpserve.dev/replica"
# The control-state ConfigMap's key where routers list the replicas out of sync.
OUT_OF_SYNC_KEY: Final = "replicas"
EVENT_SOURCE: Final = "dpserve-operator"
# Seconds a worker gets, beyond the longest request, to drain after SIGTERM.
DRAIN_MARGIN_S: Final = 30
# Seconds a stopping router pod keeps serving before its SIGTERM (its preStop pause):
# the endpoints controller and every node's kube-proxy drop it from the Service in that
# time, so no new connection lands on a socket about to close.
ROUTER_PAUSE_S: Final = 5
# The images' user (Dockerfile: USER 10001:10001), spelled out in the pods so the
# restricted Pod Security Standard's runAsNonRoot holds whatever image is named.
IMAGE_UID: Final = 10001
# The service's wire key (a Secret the operator makes) and the router's API keys (a
# Secret the user makes), mounted read-only where the processes read them.
WIRE_DIR: Final = "/etc/dpserve/wire"
WIRE_KEY: Final = "wire.key"
WIRE_KEY_FILE: Final = f"{WIRE_DIR}/{WIRE_KEY}"
AUTH_DIR: Final = "/etc/dpserve/auth"
WEBHOOK_DIR: Final = "/etc/dpserve/webhook"
WEBHOOK_SECRET: Final = "webhook-secret"
API_KEYS: Final = "api-keys"
ADMIN_KEYS: Final = "admin-keys"
# The root filesystem is read-only: every write goes to an emptyDir here, and the
# caches torch, diffusers, Hugging Face and Triton keep in $HOME are pointed at it.
SCRATCH: Final = "/tmp"
# The container that runs ``dpserve fetch`` (a fill Job's, a node-local replica's init
# container); it reports its outcome in the termination message.
FETCH_CONTAINER: Final = "fetch"
TERMINATION_LOG: Final = "/dev/termination-log"
# Bumped when the operator changes replica pods in a way old ones lack (2: wire key,
# pod-IP bind, restricted security): the spec hash changes, so they are rolled.
POD_SHAPE: Final = 2


@dataclass(frozen=True)
class Images:
    """Defaults for pods whose spec names no image (set by the chart on the operator)."""

    worker: str
    router: str
    pull_policy: str = "IfNotPresent"
    pull_secrets: tuple[str, ...] = ()

    def secrets(self) -> dict[str, Any]:
        """The pod-spec field for private registries (empty when there are none)."""
        if not self.pull_secrets:
            return {}
        return {"imagePullSecrets": [{"name": n} for n in self.pull_secrets]}


@dataclass(frozen=True)
class NodeFetch:
    """What a node-local replica's init container fetches: the source pinned to the
    revision the operator resolved (the hub's commit in the URI; for S3 the listing
    digest, refused if the bucket changed since)."""

    uri: str
    revision: str


@dataclass(frozen=True)
class Svc:
    """The parts of a DiffusionService object the builders need."""

    name: str
    namespace: str
    uid: str
    generation: int
    spec: s.DiffusionServiceSpec
    # The pipeline folder a model.source resolved to (its cache entry in the claim);
    # None until one is fetched. Without a source, model.path is the folder.
    fetched_path: str | None = None
    # With a node-local cache: what each replica's init container fetches into its node.
    node_fetch: NodeFetch | None = None

    @classmethod
    def from_object(cls, obj: dict[str, Any]) -> Svc:
        meta = obj["metadata"]
        return cls(
            name=meta["name"],
            namespace=meta["namespace"],
            uid=meta["uid"],
            generation=int(meta.get("generation", 1)),
            spec=s.DiffusionServiceSpec.model_validate(obj.get("spec") or {}),
        )

    @property
    def model_folder(self) -> str | None:
        """What replicas load: model.path, or model.source's entry once fetched."""
        return self.spec.model.path if self.spec.model.source is None else self.fetched_path

    @property
    def pod_hash(self) -> str:
        return spec_hash(self.spec, self.fetched_path if self.spec.model.source else None)


# ------------------------------------------------------------ names and labels


def replica_pod_name(svc: Svc, index: int) -> str:
    return f"{svc.name}-replica-{index}"


def headless_name(svc: Svc) -> str:
    return f"{svc.name}-replicas"


def router_name(svc: Svc) -> str:
    return f"{svc.name}-router"


def control_state_name(svc: Svc) -> str:
    return f"{svc.name}-control-state"


def wire_secret_name(svc: Svc) -> str:
    return f"{svc.name}-wire"


def labels(svc: Svc, component: str) -> dict[str, str]:
    return {
        "app.kubernetes.io/name": "dpserve",
        "app.kubernetes.io/instance": svc.name,
        "app.kubernetes.io/component": component,
        "app.kubernetes.io/managed-by": "dpserve-operator",
    }


def selector(svc: Svc, component: str) -> dict[str, str]:
    """The stable subset of labels that selects a component (never changes)."""
    full = labels(svc, component)
    return {k: full[k] for k in ("app.kubernetes.io/name", "app.kubernetes.io/instance")} | {
        "app.kubernetes.io/component": component
    }


def selector_string(svc: Svc) -> str:
    return ",".join(f"{k}={v}" for k, v in selector(svc, "replica").items())


def owner_reference(svc: Svc) -> dict[str, Any]:
    return {
        "apiVersion": f"{s.GROUP}/{s.VERSION}",
        "kind": s.KIND,
        "name": svc.name,
        "uid": svc.uid,
        "controller": True,
        "blockOwnerDeletion": True,
    }


def child_meta(svc: Svc, name: str, component: str, **extra: Any) -> dict[str, Any]:
    return {
        "name": name,
        "namespace": svc.namespace,
        "labels": labels(svc, component),
        "ownerReferences": [owner_reference(svc)],
        **extra,
    }


# ------------------------------------------------------------ replicas


def spec_hash(spec: s.DiffusionServiceSpec, fetched: str | None = None) -> str:
    """Hash of everything that shapes a replica pod; a change means a rolling replace.

    Replica count, router and update strategy are left out: changing them must
    not restart the model servers. ``POD_SHAPE`` is in: an operator whose pods differ
    (the wire key, the restricted security context) replaces the older ones. With a
    model.source, the fetched entry's folder stands for the source: a new source rolls
    the replicas once its entry is ready, not when the spec changes.
    """
    relevant = spec.model_dump(mode="json", exclude={"replicas", "router", "updateStrategy"})
    model = relevant["model"]
    for key in ("source", "credentials", "cache"):
        if model.get(key) is None:
            model.pop(key, None)  # absent as before sources existed: no roll on upgrade
    if model.get("cache"):  # a claim's hashes as before node-local caches existed
        model["cache"] = {k: v for k, v in model["cache"].items() if v is not None}
    if spec.model.source is not None:
        model.pop("source")
        model.pop("credentials", None)  # the fill Job's, not the replicas'
        model["fetched"] = fetched
    if spec.loraCacheMb == type(spec).model_fields["loraCacheMb"].default:
        relevant.pop("loraCacheMb")  # the default, as before adapter caches existed: no roll
    # Placement at its defaults is left out, as before it existed: an operator upgrade
    # does not roll running replicas (they were placed already); a change rolls them.
    for key in ("topologySpreadConstraints", "onePerNode", "priorityClassName"):
        if getattr(spec, key) == type(spec).model_fields[key].default:
            relevant.pop(key)
    if spec.router.outputStore is not None:  # replicas upload videos there (none: as before)
        relevant["outputStore"] = spec.router.outputStore.model_dump(mode="json")
    keyed = {"spec": relevant, "shape": POD_SHAPE}
    return hashlib.sha256(json.dumps(keyed, sort_keys=True).encode()).hexdigest()[:16]


def worker_options(svc: Svc, index: int) -> dict[str, Any]:
    """What a DiffusionService sets of replica ``index``'s ``WorkerConfig``, by field
    name; the options it leaves out keep the worker's defaults."""
    spec, par, rt = svc.spec, svc.spec.parallelism, svc.spec.realtime
    return {
        "model": svc.model_folder,
        "port": spec.schedulerPort,
        # The pod's own address, not every interface; the kubelet expands $(POD_IP).
        "bind": "$(POD_IP)",
        "replica": index,
        "tp": par.tp,
        "sp": par.sp,
        "ulysses": par.ulysses,  # None: derived from sp
        "ring": par.ring,
        "cfg": par.cfg,
        "threads_per_rank": spec.threadsPerRank,
        "device": spec.device,
        "max_sequence_length": spec.maxSequenceLength,  # None: the pipeline's default
        "max_batch": spec.maxBatch,
        "batch_wait_ms": spec.batchWaitMs,
        "lora_cache_mb": spec.loraCacheMb,
        "step_cache": spec.stepCache.type if spec.stepCache else None,
        "step_cache_threshold": spec.stepCache.threshold if spec.stepCache else None,
        "step_cache_interval": spec.stepCache.interval if spec.stepCache else None,
        "compile": spec.compile,
        "compile_sizes": tuple(spec.compileSizes),
        "drain_timeout_s": spec.router.requestTimeoutSeconds,  # finish what the router waits on
        "max_sessions": rt.maxSessions,
        "max_session_mb": rt.maxSessionMB,
        "session_idle_timeout_s": rt.idleTimeoutSeconds,
        "max_frames": spec.video.maxFrames,
        "video_ttl_s": float(spec.video.ttlSeconds),
        "video_max_bytes": spec.video.maxBytes,
        # Finished videos go to the router's bucket, so any router serves them after
        # this pod is gone (docs/outputs.md); its Secret is the pod's environment.
        "output_store": spec.router.outputStore.uri if spec.router.outputStore else None,
    }


def worker_args(svc: Svc, index: int) -> list[str]:
    # Weight and LoRA loads are confined to the model's mount path (the volume, or the
    # image's models folder when the model is baked in): nothing else on the pod's disk.
    return [
        "worker",
        *worker_flags(worker_options(svc, index)),
        "--wire-key-file",
        WIRE_KEY_FILE,
        "--allow-path",
        svc.spec.model.mountPath,
    ]


def _resources(spec: s.DiffusionServiceSpec) -> dict[str, Any]:
    resources = json.loads(json.dumps(spec.resources or {}))  # deep copy, JSON types only
    if spec.device == "cuda":
        gpus = spec.parallelism.gang_size
        for kind in ("limits", "requests"):
            resources.setdefault(kind, {})[spec.gpuResource] = gpus
    return resources


def probe_command(port: int, *extra: str) -> list[str]:
    """A real ping through the driver with a deadline, not a TCP check: a hung gang
    keeps its port open (docs/worker.md, Request path: a ping reports "stalled").

    The driver binds the pod IP only, and a kubelet expands no ``$(POD_IP)`` in a probe
    (only env values it knows statically), so a shell inside the container reads it.
    """
    flags = f"--port {port} --timeout 3 --wire-key-file {WIRE_KEY_FILE}"
    return ["sh", "-c", " ".join(['exec dpserve probe --host "$POD_IP"', flags, *extra])]


def _probe(port: int, *extra: str) -> dict[str, Any]:
    return {"exec": {"command": probe_command(port, *extra)}, "timeoutSeconds": 5}


def pod_security() -> dict[str, Any]:
    """Pod-level part of the restricted Pod Security Standard: the image's user, never
    root; the runtime's default seccomp profile. fsGroup owns the mounted Secrets,
    which are readable by owner and group only."""
    return {
        "runAsNonRoot": True,
        "runAsUser": IMAGE_UID,
        "runAsGroup": IMAGE_UID,
        "fsGroup": IMAGE_UID,
        "seccompProfile": {"type": "RuntimeDefault"},
    }


def container_security() -> dict[str, Any]:
    """Container-level part: no privilege escalation, no capabilities, read-only root."""
    return {
        "allowPrivilegeEscalation": False,
        "readOnlyRootFilesystem": True,
        "capabilities": {"drop": ["ALL"]},
    }


def scratch_env() -> list[dict[str, Any]]:
    """Where the libraries write, all in the scratch emptyDir (the root is read-only).

    USER too: ``getpass.getuser()`` (kopf's identity, torch's default cache names)
    fails for a uid without a passwd entry, as a ``runAsUser`` other than the image's has.
    """
    cache = f"{SCRATCH}/.cache"
    return [
        {"name": "USER", "value": "dpserve"},
        {"name": "HOME", "value": SCRATCH},
        {"name": "XDG_CACHE_HOME", "value": cache},
        {"name": "HF_HOME", "value": f"{cache}/huggingface"},
        {"name": "TRITON_CACHE_DIR", "value": f"{cache}/triton"},
        {"name": "TORCHINDUCTOR_CACHE_DIR", "value": f"{cache}/torchinductor"},
        {"name": "MPLCONFIGDIR", "value": f"{cache}/matplotlib"},
        {"name": "PYTHONDONTWRITEBYTECODE", "value": "1"},
    ]


def _secret_volume(name: str, secret: str) -> dict[str, Any]:
    # 0440: the pod's user reads it through fsGroup; nobody else in the pod does.
    return {"name": name, "secret": {"secretName": secret, "defaultMode": 0o440}}


def _wire_volume(svc: Svc) -> tuple[dict[str, Any], dict[str, Any]]:
    return (
        _secret_volume("wire", wire_secret_name(svc)),
        {"name": "wire", "mountPath": WIRE_DIR, "readOnly": True},
    )


def scratch_volume() -> tuple[dict[str, Any], dict[str, Any]]:
    return {"name": "scratch", "emptyDir": {}}, {"name": "scratch", "mountPath": SCRATCH}


def _volumes(spec: s.DiffusionServiceSpec) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    # NCCL and torch multiprocessing outgrow a container's default 64 MiB /dev/shm.
    volumes: list[dict[str, Any]] = [{"name": "dshm", "emptyDir": {"medium": "Memory"}}]
    mounts: list[dict[str, Any]] = [{"name": "dshm", "mountPath": "/dev/shm"}]
    volume = spec.model.volume
    cache = spec.model.cache
    if cache is not None and cache.nodeLocal is not None:
        # Written by the init container only (fetch_init_container); the worker reads.
        host = {"path": cache.nodeLocal.path, "type": "Directory"}
        volumes.append({"name": "model", "hostPath": host})
        mounts.append({"name": "model", "mountPath": spec.model.mountPath, "readOnly": True})
    elif cache is not None:  # replicas only read the cache the fill Job wrote
        claim = {"claimName": cache.claimName, "readOnly": True}
        volumes.append({"name": "model", "persistentVolumeClaim": claim})
        mounts.append({"name": "model", "mountPath": spec.model.mountPath, "readOnly": True})
    elif volume is not None and volume.persistentVolumeClaim is not None:
        pvc = volume.persistentVolumeClaim
        volumes.append(
            {
                "name": "model",
                "persistentVolumeClaim": {"claimName": pvc.claimName, "readOnly": pvc.readOnly},
            }
        )
        mounts.append({"name": "model", "mountPath": spec.model.mountPath, "readOnly": True})
    elif volume is not None and volume.hostPath is not None:
        volumes.append(
            {"name": "model", "hostPath": {"path": volume.hostPath.path, "type": "Directory"}}
        )
        mounts.append({"name": "model", "mountPath": spec.model.mountPath, "readOnly": True})
    return volumes, mounts


def fetch_env(spec: s.DiffusionServiceSpec) -> list[dict[str, Any]]:
    """A ``dpserve fetch`` container's variables: the scratch ones, the hub switched back
    online (the worker image sets it offline for replicas) without its bars in the log,
    then the user's."""
    return [
        *scratch_env(),
        {"name": "HF_HUB_OFFLINE", "value": "0"},
        {"name": "HF_HUB_DISABLE_PROGRESS_BARS", "value": "1"},
        *(e.model_dump(exclude_none=True) for e in spec.env or []),
    ]


def fetch_container(
    spec: s.DiffusionServiceSpec, images: Images, args: list[str], mounts: list[dict[str, Any]]
) -> dict[str, Any]:
    """A ``dpserve fetch`` container: the worker image (it holds the clients), the store's
    Secret as its environment (the only containers that get it), the outcome as its
    termination message, progress as JSON lines in its log."""
    container: dict[str, Any] = {
        "name": FETCH_CONTAINER,
        "image": spec.image or images.worker,
        "imagePullPolicy": images.pull_policy,
        "command": ["dpserve"],
        "args": args,
        "env": fetch_env(spec),
        "volumeMounts": mounts,
        "resources": {"requests": {"cpu": "500m", "memory": "512Mi"}},
        "terminationMessagePath": TERMINATION_LOG,
        "terminationMessagePolicy": "FallbackToLogsOnError",
        "securityContext": container_security(),
    }
    if spec.model.credentials is not None:
        # Variables of this container only: never arguments, never the worker's.
        container["envFrom"] = [{"secretRef": {"name": spec.model.credentials.secretName}}]
    return container


def node_fetch_args(svc: Svc) -> list[str]:
    """The init container's fetch: the pinned revision into the node's folder, refused
    if the source moved on, then the source's older entries there pruned."""
    model, pinned = svc.spec.model, svc.node_fetch
    assert pinned is not None and model.cache is not None
    return [
        "fetch",
        pinned.uri,
        "--model-cache",
        model.mountPath,
        "--json-lines",
        "--result-file",
        TERMINATION_LOG,
        "--expect-revision",
        pinned.revision,
        "--prune-keep",
        str(model.cache.keep),
    ]


def fetch_init_container(svc: Svc, images: Images) -> dict[str, Any]:
    """A node-local replica's first step: the node's cache filled (or found ready, or
    waited for under the entry's lock while another replica there fills it)."""
    mounts = [{"name": "model", "mountPath": svc.spec.model.mountPath}, scratch_volume()[1]]
    return fetch_container(svc.spec, images, node_fetch_args(svc), mounts)


def topology_spread(svc: Svc) -> list[dict[str, Any]]:
    """The replica pods' ``topologySpreadConstraints``: the spec's (spread over nodes as a
    preference when it gives none), each counting this service's replicas only."""
    given = svc.spec.topologySpreadConstraints
    chosen = s.DEFAULT_SPREAD if given is None else given
    match = {"matchLabels": selector(svc, "replica")}
    return [c.model_dump(exclude_none=True) | {"labelSelector": match} for c in chosen]


def replica_affinity(svc: Svc) -> dict[str, Any] | None:
    """The spec's affinity, plus with ``onePerNode`` a required anti-affinity to this
    service's other replicas on kubernetes.io/hostname (added to the user's terms)."""
    affinity = copy.deepcopy(svc.spec.affinity) if svc.spec.affinity else None
    if not svc.spec.onePerNode:
        return affinity
    affinity = affinity or {}
    anti = affinity.setdefault("podAntiAffinity", {})
    required = anti.setdefault("requiredDuringSchedulingIgnoredDuringExecution", [])
    required.append(
        {
            "labelSelector": {"matchLabels": selector(svc, "replica")},
            "topologyKey": s.HOSTNAME_KEY,
        }
    )
    return affinity


def pdb_max_unavailable(spec: s.DiffusionServiceSpec) -> int:
    """Replicas a voluntary disruption (an eviction: ``kubectl drain``) may take at once:
    the roll's maxUnavailable, and at least 1. A budget of 0 (a surge-only roll, or one
    replica) would block every eviction and make a drain hang forever; the operator's own
    rolls delete pods, which a budget does not govern."""
    return max(1, spec.updateStrategy.maxUnavailable)


def build_pod_disruption_budget(svc: Svc) -> dict[str, Any]:
    """How many replicas evictions may take down at once (``pdb_max_unavailable``).
    Pods that are not Ready may always be evicted: they serve nothing, and a stuck one
    must not hold a drain."""
    return {
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": child_meta(svc, headless_name(svc), "replica"),
        "spec": {
            "maxUnavailable": pdb_max_unavailable(svc.spec),
            "selector": {"matchLabels": selector(svc, "replica")},
            "unhealthyPodEvictionPolicy": "AlwaysAllow",
        },
    }


def router_topology_spread(svc: Svc) -> list[dict[str, Any]]:
    """The router pods' spread: over nodes as a preference (``ScheduleAnyway``, as the
    replicas' default), so with two routers a drained or lost node leaves one serving."""
    match = {"matchLabels": selector(svc, "router")}
    return [c.model_dump(exclude_none=True) | {"labelSelector": match} for c in s.DEFAULT_SPREAD]


def build_router_disruption_budget(svc: Svc) -> dict[str, Any]:
    """Evictions take one router pod at a time. Made at every router count: with one
    router ``maxUnavailable: 1`` still lets a drain evict it (a budget of 0 would hang
    the drain), with two or more one router always serves; no budget to add or prune
    when ``spec.router.replicas`` changes."""
    return {
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": child_meta(svc, router_name(svc), "router"),
        "spec": {
            "maxUnavailable": 1,
            "selector": {"matchLabels": selector(svc, "router")},
            "unhealthyPodEvictionPolicy": "AlwaysAllow",
        },
    }


def router_grace_seconds(spec: s.DiffusionServiceSpec) -> int:
    """The router pod's grace period: its preStop pause, then its longest request (uvicorn
    finishes in-flight requests on SIGTERM), then the lifespan's close (the video leases
    handed over) within the worker's margin."""
    return ROUTER_PAUSE_S + spec.router.requestTimeoutSeconds + DRAIN_MARGIN_S


def build_replica_pod(svc: Svc, index: int, images: Images) -> dict[str, Any]:
    spec = svc.spec
    volumes, mounts = _volumes(spec)
    for volume, mount in (_wire_volume(svc), scratch_volume()):
        volumes.append(volume)
        mounts.append(mount)
    env = [
        {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
        {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
        *scratch_env(),
        *(e.model_dump(exclude_none=True) for e in spec.env or []),  # the user's win
    ]
    container: dict[str, Any] = {
        "name": "worker",
        "image": spec.image or images.worker,
        "imagePullPolicy": images.pull_policy,
        "command": ["dpserve"],
        "args": worker_args(svc, index),
        "env": env,
        "ports": [{"name": "zmq", "containerPort": spec.schedulerPort, "protocol": "TCP"}],
        "resources": _resources(spec),
        "volumeMounts": mounts,
        # A worker that refuses to start (a layout the model cannot split, say) says why
        # in its last log lines; the kubelet puts them in the status the operator reports.
        "terminationMessagePolicy": "FallbackToLogsOnError",
        # Start-up loads the model and warms up; the driver binds only after that.
        "startupProbe": {**_probe(spec.schedulerPort), "periodSeconds": 5, "failureThreshold": 360},
        "readinessProbe": {**_probe(spec.schedulerPort), "periodSeconds": 5},
        "livenessProbe": {
            **_probe(spec.schedulerPort, "--live"),
            "periodSeconds": 15,
            "failureThreshold": 4,
        },
        "securityContext": container_security(),
    }
    store = spec.router.outputStore
    if store is not None and store.credentials is not None:
        # The same Secret as the router pods': the replicas write what routers read.
        container["envFrom"] = [{"secretRef": {"name": store.credentials.secretName}}]
    pod_spec: dict[str, Any] = {
        **({"initContainers": [fetch_init_container(svc, images)]} if svc.node_fetch else {}),
        "containers": [container],
        "volumes": volumes,
        "restartPolicy": "Always",
        "hostname": replica_pod_name(svc, index),
        "subdomain": headless_name(svc),
        "terminationGracePeriodSeconds": spec.router.requestTimeoutSeconds + DRAIN_MARGIN_S,
        "securityContext": pod_security(),
        # Workers never call the Kubernetes API: no token to steal from a replica.
        "automountServiceAccountToken": False,
        "enableServiceLinks": False,
        **images.secrets(),
    }
    for key, value in (
        ("nodeSelector", spec.nodeSelector),
        ("tolerations", spec.tolerations),
        ("affinity", replica_affinity(svc)),
        ("topologySpreadConstraints", topology_spread(svc)),
        ("priorityClassName", spec.priorityClassName),
    ):
        if value:
            pod_spec[key] = value
    meta = child_meta(
        svc,
        replica_pod_name(svc, index),
        "replica",
        annotations={SPEC_HASH: svc.pod_hash},
    )
    meta["labels"][REPLICA_LABEL] = str(index)
    return {"apiVersion": "v1", "kind": "Pod", "metadata": meta, "spec": pod_spec}


def build_headless_service(svc: Svc) -> dict[str, Any]:
    """Only Ready replicas appear in its EndpointSlices: that is what the router follows."""
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": child_meta(svc, headless_name(svc), "replica"),
        "spec": {
            "clusterIP": "None",
            "selector": selector(svc, "replica"),
            "ports": [
                {"name": "zmq", "port": svc.spec.schedulerPort, "targetPort": "zmq"},
            ],
            "publishNotReadyAddresses": False,
        },
    }


def build_control_state(svc: Svc) -> dict[str, Any]:
    """Where the routers keep the desired control state (key ``state``) and the replicas
    not yet brought to it (key ``replicas``), so every router and a restart see them.

    Created once; the routers own the content afterwards. It starts with no replica
    out of sync, so the key is never missing for a reader.
    """
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": child_meta(svc, control_state_name(svc), "router"),
        "data": {OUT_OF_SYNC_KEY: "{}"},
    }


def build_wire_secret(svc: Svc, secret_key: bytes) -> dict[str, Any]:
    """The service's wire key (z85 CURVE secret key), shared by its router and replicas.

    Created once and never read back: the operator needs no get on Secrets, so its
    RBAC can deny reading the Secrets it did not create. ``secret_key`` comes from
    ``WireKey.generate()``; the builder stays a function of its inputs.
    """
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": child_meta(svc, wire_secret_name(svc), "wire"),
        "type": "Opaque",
        "stringData": {WIRE_KEY: secret_key.decode()},
    }


def build_network_policy(svc: Svc) -> dict[str, Any]:
    """Replica pods admit traffic only from the same service's router pods, on the ZMQ
    port (a gang's ranks talk inside the pod; exec probes run inside it too)."""
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": child_meta(svc, headless_name(svc), "replica"),
        "spec": {
            "podSelector": {"matchLabels": selector(svc, "replica")},
            "policyTypes": ["Ingress"],
            "ingress": [
                {
                    "from": [{"podSelector": {"matchLabels": selector(svc, "router")}}],
                    "ports": [{"protocol": "TCP", "port": svc.spec.schedulerPort}],
                }
            ],
        },
    }


# ------------------------------------------------------------ router


def router_options(svc: Svc) -> dict[str, Any]:
    """What a DiffusionService sets of its routers' ``RouterConfig``, by field name;
    the options it leaves out keep the router's defaults."""
    r = svc.spec.router
    return {
        "discovery": "kubernetes",
        "namespace": svc.namespace,
        "service": headless_name(svc),
        "control_state_configmap": control_state_name(svc),
        "wire_key_file": WIRE_KEY_FILE,
        "host": "0.0.0.0",
        "port": ROUTER_PORT,
        "request_timeout": r.requestTimeoutSeconds,
        "max_inflight_per_replica": r.maxInflightPerReplica,
        "policy": r.policy,
        "adapter_routing": r.adapterRouting,
        "adapter_home_slack": r.adapterHomeSlack,
        "lora": tuple(f"{name}={path}" for name, path in sorted(r.loras.items())),
        "max_waiting": r.maxWaiting,
        "served_model_name": r.servedModelName or svc.name,
        "video_max_estimate": r.videoMaxEstimateSeconds,
        "max_connections_per_peer": r.maxConnectionsPerPeer,
        "max_requests_per_tenant": r.maxRequestsPerTenant,
        "tenant_weight": tuple(f"{name}={w}" for name, w in sorted(r.tenantWeights.items())),
        "allowed_host": (*router_host_names(svc), *r.allowedHosts),
        # Its credentials come as the pod's environment (build_router_deployment).
        "output_store": r.outputStore.uri if r.outputStore else None,
        "output_url_ttl": r.outputStore.urlTtlSeconds if r.outputStore else None,
        # The user's key Secret, mounted at AUTH_DIR (build_router_deployment).
        "api_key_file": (f"{AUTH_DIR}/{API_KEYS}",) if r.auth else (),
        "admin_key_file": (f"{AUTH_DIR}/{ADMIN_KEYS}",) if r.auth else (),
        # The user's webhook Secret, mounted at WEBHOOK_DIR (build_router_deployment).
        "webhook_url": r.webhook.url if r.webhook else None,
        "webhook_secret_file": f"{WEBHOOK_DIR}/{WEBHOOK_SECRET}" if r.webhook else None,
        "webhook_retry_for": r.webhook.retryForSeconds if r.webhook else None,
    }


def router_host_names(svc: Svc) -> tuple[str, ...]:
    """The names the router Service is reached by in the cluster (the router answers
    no other Host but IP literals and localhost: dpserve/router/hosts.py). A cluster
    whose domain is not cluster.local adds its own in spec.router.allowedHosts."""
    name, ns = svc.name, svc.namespace
    return (name, f"{name}.{ns}", f"{name}.{ns}.svc", f"{name}.{ns}.svc.cluster.local")


def router_args(svc: Svc) -> list[str]:
    return ["router", *router_flags(router_options(svc))]


def build_router_deployment(svc: Svc, images: Images) -> dict[str, Any]:
    r = svc.spec.router
    wire_volume, wire_mount = _wire_volume(svc)
    scratch, scratch_mount = scratch_volume()
    scratch["emptyDir"] = {"sizeLimit": "64Mi"}
    volumes, mounts = [wire_volume, scratch], [wire_mount, scratch_mount]
    if r.auth:
        volumes.append(_secret_volume("auth", r.auth.secretName))
        mounts.append({"name": "auth", "mountPath": AUTH_DIR, "readOnly": True})
    if r.webhook:
        volumes.append(_secret_volume("webhook", r.webhook.secretName))
        mounts.append({"name": "webhook", "mountPath": WEBHOOK_DIR, "readOnly": True})
    container = {
        "name": "router",
        "image": r.image or images.router,
        "imagePullPolicy": images.pull_policy,
        "command": ["dpserve"],
        "args": router_args(svc),
        "ports": [{"name": "http", "containerPort": ROUTER_PORT, "protocol": "TCP"}],
        "readinessProbe": {"httpGet": {"path": "/ready", "port": "http"}, "periodSeconds": 2},
        "livenessProbe": {"httpGet": {"path": "/livez", "port": "http"}, "periodSeconds": 10},
        "resources": r.resources or {"requests": {"cpu": "100m", "memory": "128Mi"}},
        "env": scratch_env(),
        "volumeMounts": mounts,
        "securityContext": container_security(),
        # Kept serving while it leaves the Service's endpoints, then SIGTERM. The kubelet
        # sleeps (no binary in the image needed; Kubernetes 1.30+, beta on by default).
        "lifecycle": {"preStop": {"sleep": {"seconds": ROUTER_PAUSE_S}}},
    }
    if r.outputStore and r.outputStore.credentials:
        # The output store's Secret as the environment boto3 reads (AWS_*), as a model
        # source's reaches its fill Job (the replica pods get it too: their videos).
        container["envFrom"] = [{"secretRef": {"name": r.outputStore.credentials.secretName}}]
    template = {
        "metadata": {"labels": labels(svc, "router")},
        "spec": {
            "serviceAccountName": router_name(svc),  # it reads EndpointSlices: a token
            "containers": [container],
            "terminationGracePeriodSeconds": router_grace_seconds(svc.spec),
            "topologySpreadConstraints": router_topology_spread(svc),
            "volumes": volumes,
            "securityContext": pod_security(),
            "enableServiceLinks": False,
            **images.secrets(),
        },
    }
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": child_meta(svc, router_name(svc), "router"),
        "spec": {
            "replicas": r.replicas,
            "selector": {"matchLabels": selector(svc, "router")},
            "template": template,
        },
    }


def build_router_service(svc: Svc) -> dict[str, Any]:
    svc_spec = svc.spec.router.service
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": child_meta(svc, svc.name, "router"),
        "spec": {
            "type": svc_spec.type,
            "selector": selector(svc, "router"),
            "ports": [{"name": "http", "port": svc_spec.port, "targetPort": "http"}],
        },
    }


# The router reads its replicas' EndpointSlices and keeps the control state.
ROUTER_RULES: Final = (
    {
        "apiGroups": ["discovery.k8s.io"],
        "resources": ["endpointslices"],
        "verbs": ["list", "watch"],
    },
    {"apiGroups": [""], "resources": ["configmaps"], "verbs": ["get", "update"]},
)


def build_router_rbac(svc: Svc) -> list[dict[str, Any]]:
    name = router_name(svc)
    rules = [dict(rule) for rule in ROUTER_RULES]
    rules[1] = {**rules[1], "resourceNames": [control_state_name(svc)]}
    return [
        {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": child_meta(svc, name, "router")},
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "Role",
            "metadata": child_meta(svc, name, "router"),
            "rules": rules,
        },
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "RoleBinding",
            "metadata": child_meta(svc, name, "router"),
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": name},
            "subjects": [{"kind": "ServiceAccount", "name": name, "namespace": svc.namespace}],
        },
    ]


def build_children(svc: Svc, images: Images) -> list[dict[str, Any]]:
    """Every child except the replica pods (planned one by one) and the wire Secret
    (its content is random, made once: ``build_wire_secret``)."""
    return [
        build_headless_service(svc),
        build_network_policy(svc),
        build_pod_disruption_budget(svc),
        build_control_state(svc),
        *build_router_rbac(svc),
        build_router_disruption_budget(svc),
        build_router_deployment(svc, images),
        build_router_service(svc),
    ]


# ------------------------------------------------------------ events


def build_event(
    owner: Mapping[str, Any], kind: str, reason: str, message: str, now: datetime
) -> dict[str, Any]:
    """A core/v1 Event about a DiffusionService (``owner`` is its object, as read).

    The server picks the name (``generateName``), so two events never collide.
    """
    meta = owner["metadata"]
    stamp = now.astimezone(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
    return {
        "apiVersion": "v1",
        "kind": "Event",
        "metadata": {"generateName": f"{meta['name']}.", "namespace": meta["namespace"]},
        "involvedObject": {
            "apiVersion": f"{s.GROUP}/{s.VERSION}",
            "kind": s.KIND,
            "name": meta["name"],
            "namespace": meta["namespace"],
            "uid": meta["uid"],
        },
        "type": kind,
        "reason": reason,
        "message": message[:1000],
        "source": {"component": EVENT_SOURCE},
        "reportingComponent": EVENT_SOURCE,
        "firstTimestamp": stamp,
        "lastTimestamp": stamp,
        "count": 1,
    }
