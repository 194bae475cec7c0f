"""kopf handlers: thin wrappers that read state, call the pure parts, apply, write status.

One level-based reconcile serves create, update, resume, a drift timer and
events of the replica pods, the router Deployment and the control-state
ConfigMap; a per-object lock keeps them from interleaving. Nothing sleeps in a
handler: API conflicts raise ``kopf.TemporaryError`` and the work is retried
with a delay. Every action is recorded as an Event on the DiffusionService.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import json
import logging
import os
from collections.abc import Mapping
from datetime import datetime, timezone
from typing import Any, Final

import kopf
from kubernetes.client.exceptions import ApiException
from pydantic import ValidationError

from dpserve.contract.layout import LayoutError, ParallelConfig
from dpserve.operator import builders as b
from dpserve.operator import fill_job as f
from dpserve.operator import spec as s
from dpserve.operator import wire
from dpserve.operator.kube import Kube
from dpserve.operator.model_state import (
    FillFacts,
    ModelStep,
    fetching_now,
    model_step,
    needs_fill,
    node_step,
    previous_model,
    prune_due,
)
from dpserve.operator.plan import Note, Plan, plan, why_create, why_delete
from dpserve.operator.status import (
    POD_REFUSED,
    compute_status,
    known_indices,
    parse_control_state,
    pod_facts,
)
from dpserve.plumbing.curve import WireKey
from dpserve.plumbing.kubeconfig import load_config

log = logging.getLogger(__name__)
ANNOTATION_PREFIX = "dpserve.dev"
# The objects the operator makes: the event handlers' watches select only these on
# the server, so the operator never caches every pod or ConfigMap of the cluster.
MANAGED = "app.kubernetes.io/managed-by=dpserve-operator"
DRIFT_INTERVAL_S = 10.0
RETRY_S = 5.0  # after an unexpected API error (kopf's default would wait a minute)


class Runtime:
    """What the handlers share, created at start-up (kopf's memo holds it)."""

    def __init__(self, kube: Kube, images: b.Images, allow_host_path: bool = False) -> None:
        self.kube = kube
        self.images = images
        self.allow_host_path = allow_host_path
        self._locks: dict[tuple[str, str], asyncio.Lock] = {}
        # A reconcile waiting for the lock will read the newest state anyway, so
        # events arriving meanwhile need not queue another one behind it.
        self.waiting: set[tuple[str, str]] = set()
        # Hash of the children last applied per object: unchanged children are
        # re-applied only by the drift check, not on every pod event.
        self.applied: dict[tuple[str, str], str] = {}

    def lock(self, namespace: str, name: str) -> asyncio.Lock:
        return self._locks.setdefault((namespace, name), asyncio.Lock())


def images_from_env() -> b.Images:
    secrets = os.environ.get("DPSERVE_IMAGE_PULL_SECRETS", "")
    return b.Images(
        worker=os.environ.get("DPSERVE_WORKER_IMAGE", "dpserve-worker:latest"),
        router=os.environ.get("DPSERVE_ROUTER_IMAGE", "dpserve-router:latest"),
        pull_policy=os.environ.get("DPSERVE_IMAGE_PULL_POLICY", "IfNotPresent"),
        pull_secrets=tuple(s.strip() for s in secrets.split(",") if s.strip()),
    )


def allow_host_path_from_env() -> bool:
    """The chart's ``allowHostPathModels`` (off unless the value says true)."""
    return os.environ.get("DPSERVE_ALLOW_HOSTPATH_MODELS", "false").strip().lower() == "true"


@kopf.on.startup()
async def configure(settings: kopf.OperatorSettings, memo: kopf.Memo, **_: Any) -> None:
    # kopf's own bookkeeping goes to annotations: the structural schema would
    # silently prune anything it wrote into status (docs/operator.md, Reconcile).
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(
        prefix=ANNOTATION_PREFIX
    )
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
        prefix=ANNOTATION_PREFIX, key="last-handled-configuration"
    )
    settings.posting.level = logging.WARNING
    settings.watching.server_timeout = 300
    settings.watching.client_timeout = 330
    for resource in ("pods", ("apps", "deployments"), "configmaps"):
        settings.watching.label_selectors[resource] = MANAGED
    # Namespaced: the namespaces are named exactly and the CRD exists before the
    # operator (Helm installs crds/ first), so kopf needs no cluster-scoped watch of
    # namespaces or CRDs, and the chart grants nothing outside the watched namespaces.
    if memo.get("namespaces"):
        settings.scanning.disabled = True
    load_config()
    memo.runtime = Runtime(Kube(), images_from_env(), allow_host_path_from_env())
    memo.drift = asyncio.create_task(drift_loop(memo.runtime, list(memo.get("namespaces", []))))


def _check_beyond_crd(spec: s.DiffusionServiceSpec, allow_host_path: bool) -> None:
    """Rules the apiserver may not have enforced; a violation is reported, never crashes."""
    found = s.problems(spec, allow_host_path)
    if found:
        raise InvalidSpec("; ".join(found))
    par = spec.parallelism
    ParallelConfig(tp=par.tp, sp=par.sp, ulysses=par.ulysses or 1, ring=par.ring or 1, cfg=par.cfg)


class InvalidSpec(ValueError):
    pass


async def reconcile(
    runtime: Runtime, namespace: str, name: str, coalesce: bool = False, drift: bool = False
) -> None:
    key = (namespace, name)
    if coalesce and key in runtime.waiting:
        return
    runtime.waiting.add(key)
    lock = runtime.lock(namespace, name)
    try:
        await lock.acquire()
    finally:  # acquired, or cancelled while waiting: either way no longer waiting
        runtime.waiting.discard(key)
    try:
        await _reconcile(runtime, namespace, name, drift)
    except ApiException as exc:
        if exc.status in (409, 429, 500, 503):
            raise kopf.TemporaryError(f"API answered {exc.status}; retrying", delay=2) from exc
        raise
    finally:
        lock.release()


async def _reconcile(runtime: Runtime, namespace: str, name: str, drift: bool) -> None:
    kube = runtime.kube
    obj = await kube.get_service(namespace, name)
    if obj is None or obj["metadata"].get("deletionTimestamp"):
        return  # owner references take the children with it
    try:
        svc = b.Svc.from_object(obj)
        _check_beyond_crd(svc.spec, runtime.allow_host_path)
    except (ValidationError, LayoutError, InvalidSpec) as exc:
        await _report_invalid(kube, obj, str(exc))
        return
    previous = obj.get("status") or {}
    step = await _model(runtime, obj, svc, previous)
    svc = dataclasses.replace(svc, fetched_path=step.fetched_path, node_fetch=step.node_fetch)
    children = b.build_children(svc, runtime.images)
    digest = hashlib.sha256(json.dumps(children, sort_keys=True).encode()).hexdigest()
    if drift or runtime.applied.get((namespace, name)) != digest:
        # The wire key first: pods mount it. A fresh key each time, kept only when the
        # Secret is new (409 otherwise): the operator never reads a Secret, so one it
        # did not create is refused (dpserve/operator/wire.py).
        if not await _wire_secret(kube, obj, svc, previous):
            return
        for child in children:
            if child["kind"] == "ConfigMap":
                await kube.create_if_absent(child)
            else:
                await kube.apply(child)
        runtime.applied[(namespace, name)] = digest
    selector = b.selector_string(svc)
    pods = await kube.list_pods(namespace, selector)
    views = {v.name: v for v in (pod_facts(p).view for p in pods)}
    replicas = svc.spec.replicas
    # Without a model to load yet, no replica pod is made or replaced: the ones that
    # exist keep serving what they load, and new ones wait for the fetch.
    todo = (
        plan(
            replicas=replicas,
            current_hash=svc.pod_hash,
            max_unavailable=svc.spec.updateStrategy.maxUnavailable,
            max_surge=svc.spec.updateStrategy.maxSurge,
            pods=list(views.values()),
        )
        if step.fetched_path is not None
        else Plan(create=(), delete=())
    )
    known = known_indices(previous)
    for pod_name in todo.delete:
        await kube.delete_pod(namespace, pod_name)
        await _record(kube, obj, why_delete(views[pod_name], replicas))
    refused: dict[int, str] = {}
    for index in todo.create:
        pod = b.build_replica_pod(svc, index, runtime.images)
        try:
            created = await kube.create_pod(pod)
        except ApiException as exc:
            if exc.status not in REFUSED_CREATE:
                raise
            # Admission said no (a priorityClassName with no PriorityClass, a quota, a
            # policy): retrying now would fail the same way, so status says why and the
            # drift loop tries again later.
            refused[index] = refusal_message(exc)
            continue
        if created:
            note = why_create(index, pod["metadata"]["name"], replicas, known)
            await _record(kube, obj, note)
    if refused:
        await _record_refusals(kube, obj, svc, previous, refused)
    if not todo.empty:
        pods = await kube.list_pods(namespace, selector)
    step = await _node_fetches(runtime, obj, svc, step, pods)
    router = await kube.get_deployment(namespace, b.router_name(svc))
    control = parse_control_state(await kube.get_configmap(namespace, b.control_state_name(svc)))
    if control.problem:
        log.warning("%s/%s: control state ignored: %s", namespace, name, control.problem)
    status = compute_status(
        svc, pods, previous, router=router, control=control, model=step, refused=refused
    )
    if wire.RECORD in previous:
        status[wire.RECORD] = previous[wire.RECORD]
    pruned = prune_due(svc, step, status)
    if pruned is not None:
        await _prune(runtime, obj, svc, pruned)
        status["model"]["pruned"] = pruned
    await kube.patch_status(namespace, name, status)


# What the apiserver answers a pod create it refuses (admission plugins, webhooks,
# validation); other statuses are transient or a bug, and raise.
REFUSED_CREATE: Final = frozenset({400, 403, 422})


def refusal_message(exc: ApiException) -> str:
    """The apiserver's own message for a refused create (its Status body), else the reason."""
    try:
        body = json.loads(exc.body or "")
    except (TypeError, ValueError):
        body = None
    if isinstance(body, dict) and body.get("message"):
        return str(body["message"])
    return f"{exc.status} {exc.reason}"


async def _record_refusals(
    kube: Kube,
    obj: dict[str, Any],
    svc: b.Svc,
    previous: dict[str, Any],
    refused: Mapping[int, str],
) -> None:
    """A Warning Event per refused replica, once while the same refusal stands (the
    previous Degraded condition says it: the drift loop retries without a new Event)."""
    conditions = previous.get("conditions") or []
    degraded: dict[str, Any] = next((c for c in conditions if c.get("type") == "Degraded"), {})
    said = str(degraded.get("message") or "")
    for index, message in sorted(refused.items()):
        if f"{b.replica_pod_name(svc, index)}: {POD_REFUSED}: {message}" not in said:
            note = Note(POD_REFUSED, f"replica {index}: the apiserver refused its pod: {message}")
            await _record(kube, obj, note, kind="Warning")


async def _wire_secret(
    kube: Kube, obj: dict[str, Any], svc: b.Svc, previous: dict[str, Any]
) -> bool:
    """Create the wire Secret, or find the one there is the operator's own; False (and
    reported) when it is not, so nothing that would mount it is made."""
    secret = b.build_wire_secret(svc, WireKey.generate().secret)
    name = secret["metadata"]["name"]
    created = await kube.create_if_absent(secret)
    if not wire.owned(name, created, previous):
        await _report_refusal(kube, obj, wire.refusal(svc.namespace, name))
        return False
    if previous.get(wire.RECORD) != name:  # recorded at once: a crash next must not lose it
        await kube.patch_status(svc.namespace, svc.name, {wire.RECORD: name})
        previous[wire.RECORD] = name
    return True


async def _prune(runtime: Runtime, obj: dict[str, Any], svc: b.Svc, loaded: str) -> None:
    """After a roll onto ``loaded``: the cache claim's clean-up Job, sparing every folder
    a DiffusionService of the namespace loads from that claim."""
    claim = svc.spec.model.cache.claimName if svc.spec.model.cache else ""
    protect = [
        str(found.loaded.path)
        for other in await runtime.kube.list_services(svc.namespace)
        if (found := previous_model(other.get("status") or {})) is not None
        and found.loaded is not None
        and found.loaded.claim == claim
    ]
    job = f.build_prune_job(svc, runtime.images, loaded, protect)
    if await runtime.kube.create_job(job):
        note = Note("CachePruning", f"pruning claim {claim}: Job {job['metadata']['name']}")
        await _record(runtime.kube, obj, note)


# Lines of a fill pod's log read for its last progress line (its log lines on stderr,
# one every 10 s, come between the progress lines, one every 2 s).
FILL_LOG_LINES = 20


async def _model(
    runtime: Runtime, obj: dict[str, Any], svc: b.Svc, previous: dict[str, Any]
) -> ModelStep:
    """Where model.source stands; starts (or restarts) its fill Job and records the
    fetch's Events."""
    kube, namespace = runtime.kube, svc.namespace
    before = previous_model(previous)
    facts = FillFacts()
    if needs_fill(svc, before):
        name = f.fill_job_name(svc)
        job = await kube.get_job(namespace, name)
        pod = None
        if job is not None:
            pods = await kube.list_pods(namespace, f.pods_selector(name))
            pod = max(pods, key=_created, default=None)
        tail = None
        if pod is not None and (pod.get("status") or {}).get("phase") == "Running":
            tail = await kube.read_log(
                namespace, pod["metadata"]["name"], f.CONTAINER, FILL_LOG_LINES
            )
        facts = FillFacts(job=job, pod=pod, log_tail=tail)
    step = model_step(svc, before, facts)
    if step.delete_job:
        await kube.delete_job(namespace, f.fill_job_name(svc))
    if step.create_job and await kube.create_job(f.build_fill_job(svc, runtime.images)):
        source, made = svc.spec.model.source, f.fill_job_name(svc)
        node = svc.spec.model.cache.nodeLocal if svc.spec.model.cache else None
        started = (
            f"pinning {source}: Job {made}; then each node's first replica fetches it into "
            f"{node.path}"
            if node is not None
            else f"fetching {source}: Job {made}"
        )
        await _record(kube, obj, Note("FetchStarted", started))
    for kind, note in step.notes:
        await _record(kube, obj, note, kind=kind)
    return step


async def _node_fetches(
    runtime: Runtime, obj: dict[str, Any], svc: b.Svc, step: ModelStep, pods: list[dict[str, Any]]
) -> ModelStep:
    """Node-local: the replicas' fetches into their nodes, read from their init
    containers (the newest progress line of each running one's log); records the
    Events. Any other step is returned as it is."""
    if step.node_fetch is None:
        return step
    tails = {
        name: await runtime.kube.read_log(svc.namespace, name, f.CONTAINER, FILL_LOG_LINES)
        for name in fetching_now(svc, pods)
    }
    before = previous_model(obj.get("status") or {})
    refined = node_step(svc, step, before, pods, tails)
    for kind, note in refined.notes[len(step.notes) :]:
        await _record(runtime.kube, obj, note, kind=kind)
    return refined


def _created(pod: dict[str, Any]) -> str:
    return str(pod["metadata"].get("creationTimestamp") or "")


async def _record(kube: Kube, obj: dict[str, Any], note: Note, kind: str = "Normal") -> None:
    """An Event on the DiffusionService; one that cannot be posted is only logged."""
    meta = obj["metadata"]
    log.info("%s/%s: %s: %s", meta["namespace"], meta["name"], note.reason, note.message)
    event = b.build_event(obj, kind, note.reason, note.message, datetime.now(timezone.utc))
    try:
        await kube.create_event(event)
    except ApiException as exc:
        log.warning("event %s on %s not recorded: %s", note.reason, meta["name"], exc.status)


async def _report_invalid(kube: Kube, obj: dict[str, Any], message: str) -> None:
    await _report_refusal(kube, obj, Note("SpecRefused", message), reason="InvalidSpec")


async def _report_refusal(
    kube: Kube, obj: dict[str, Any], note: Note, reason: str | None = None
) -> None:
    """A service the operator will not build: a Warning Event (once per refusal) and a
    Degraded condition with ``reason`` (the note's own by default) and its message."""
    meta = obj["metadata"]
    reason = reason or note.reason
    message = note.message
    previous = {c.get("type"): c for c in (obj.get("status") or {}).get("conditions") or []}
    old = previous.get("Degraded") or {}
    if old.get("reason") != reason or old.get("message") != message[:1000]:
        # Once per refusal, not on every drift check while it stands.
        await _record(kube, obj, note, kind="Warning")
    condition = {
        "type": "Degraded",
        "status": "True",
        "reason": reason,
        "message": message[:1000],
        "observedGeneration": meta.get("generation"),
        "lastTransitionTime": old.get("lastTransitionTime")
        if old.get("reason") == reason
        else _now(),
    }
    others = [c for t, c in previous.items() if t != "Degraded"]
    status = {"observedGeneration": meta.get("generation"), "conditions": [*others, condition]}
    await kube.patch_status(meta["namespace"], meta["name"], status)


def _now() -> str:
    from datetime import datetime, timezone

    return datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


@kopf.on.create(s.GROUP, s.VERSION, s.PLURAL, backoff=RETRY_S)
@kopf.on.update(s.GROUP, s.VERSION, s.PLURAL, backoff=RETRY_S)
@kopf.on.resume(s.GROUP, s.VERSION, s.PLURAL, backoff=RETRY_S)
async def on_change(namespace: str | None, name: str, memo: Any, **_: Any) -> None:
    await reconcile(memo.runtime, namespace or "", name)


async def drift_loop(runtime: Runtime, namespaces: list[str]) -> None:
    """Re-reconcile every DiffusionService periodically: children deleted or edited
    behind the operator's back come back.

    A task of our own rather than a kopf timer: kopf guards timers with a finalizer
    on the CR, which would block deleting a CR whenever the operator is down.
    """
    while True:
        await asyncio.sleep(DRIFT_INTERVAL_S)
        try:
            scopes: list[str | None] = list(namespaces) or [None]
            found = [obj for ns in scopes for obj in await runtime.kube.list_services(ns)]
        except ApiException as exc:
            log.warning("drift check could not list DiffusionServices: %s", exc.status)
            continue
        for obj in found:
            meta = obj["metadata"]
            try:
                await reconcile(runtime, meta["namespace"], meta["name"], drift=True)
            except Exception as exc:  # the next round retries; one bad CR must not stop it
                log.warning(
                    "drift reconcile of %s/%s failed: %s", meta["namespace"], meta["name"], exc
                )


@kopf.on.cleanup()
async def stop_drift(memo: Any, **_: Any) -> None:
    task = getattr(memo, "drift", None)
    if task is not None:
        task.cancel()


@kopf.on.event(
    "pods",
    labels={"app.kubernetes.io/name": "dpserve", "app.kubernetes.io/component": "replica"},
)
@kopf.on.event(
    "apps",
    "deployments",
    labels={"app.kubernetes.io/name": "dpserve", "app.kubernetes.io/component": "router"},
)
@kopf.on.event(
    "configmaps",
    labels={"app.kubernetes.io/name": "dpserve", "app.kubernetes.io/component": "router"},
)
@kopf.on.event(
    "pods",
    labels={"app.kubernetes.io/name": "dpserve", "app.kubernetes.io/component": f.COMPONENT},
)
async def on_child(namespace: str | None, labels: Mapping[str, str], memo: Any, **_: Any) -> None:
    """A replica pod (ready, gone, failing), the router Deployment (available or not),
    the control state (a replica out of sync) or a fill pod (started, done, failed)
    changed: reconcile the owner now."""
    owner = labels.get("app.kubernetes.io/instance")
    if owner:
        try:
            await reconcile(memo.runtime, namespace or "", owner, coalesce=True)
        except kopf.TemporaryError as exc:  # the drift timer will catch up
            log.info("reconcile after a child's event deferred: %s", exc)
