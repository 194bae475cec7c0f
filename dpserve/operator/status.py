"""Status of a DiffusionService, computed from its pods, its router Deployment and the
routers' control-state ConfigMap: pure, so tested on dicts."""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any, Final, TypeGuard

from dpserve.contract.layout import LayoutError, replica_endpoint
from dpserve.operator import builders as b
from dpserve.operator.model_state import ModelStep
from dpserve.operator.plan import PodView
from dpserve.operator.spec import Condition, DiffusionServiceStatus, ReplicaStatus

# Container waiting reasons that mean "this will not fix itself soon".
_BAD_WAITING: Final = frozenset(
    {
        "CrashLoopBackOff",
        "ImagePullBackOff",
        "ErrImagePull",
        "CreateContainerConfigError",
        "CreateContainerError",
        "InvalidImageName",
    }
)


@dataclass(frozen=True)
class PodFacts:
    view: PodView
    phase: str
    node: str | None
    reason: str | None  # why it is not ready, when something is wrong
    message: str | None
    ip: str | None = None


@dataclass(frozen=True)
class Unsynced:
    """A router's word that a replica lacks the desired control state."""

    reason: str
    since: float | None
    router: str | None

    def describe(self) -> str:
        when = (
            datetime.fromtimestamp(self.since, timezone.utc).strftime(" since %Y-%m-%dT%H:%M:%SZ")
            if self.since is not None
            else ""
        )
        return f"{self.reason} (router {self.router or '?'}{when})"


@dataclass(frozen=True)
class SyncReports:
    """What the routers say in the control-state ConfigMap: replicas out of sync, by
    endpoint (``tcp://podIP:port``). ``problem`` says why it could not be read."""

    out_of_sync: Mapping[str, Unsynced] = field(default_factory=dict)
    problem: str | None = None


def parse_control_state(configmap: Mapping[str, Any] | None) -> SyncReports:
    """Never raises: the routers write this, and a bad write must not stop the operator."""
    raw = ((configmap or {}).get("data") or {}).get(b.OUT_OF_SYNC_KEY)
    if not raw:
        return SyncReports()
    try:
        doc = json.loads(raw)
    except ValueError as exc:
        return SyncReports(problem=f"{b.OUT_OF_SYNC_KEY!r} is not JSON: {exc}")
    if not isinstance(doc, dict):
        return SyncReports(problem=f"{b.OUT_OF_SYNC_KEY!r} is not a JSON object")
    out: dict[str, Unsynced] = {}
    for endpoint, entry in doc.items():
        entry = entry if isinstance(entry, dict) else {}
        since = entry.get("since")
        router = entry.get("router")
        out[endpoint] = Unsynced(
            reason=str(entry.get("reason") or "out of sync"),
            since=float(since) if _plausible_time(since) else None,
            router=str(router) if router else None,
        )
    return SyncReports(out_of_sync=out)


def _plausible_time(value: Any) -> TypeGuard[float]:
    """A unix time that formats as a date (JSON allows NaN, Infinity and 1e300)."""
    return (
        isinstance(value, (int, float))
        and not isinstance(value, bool)
        and math.isfinite(value)
        and 0 <= value < 253402300800  # year 10000
    )


def router_available(deployment: Mapping[str, Any] | None) -> tuple[bool, str]:
    """Servable needs at least one router pod that passes its readiness probe (which
    itself needs a replica that can serve); the message says how many there are."""
    if deployment is None:
        return False, "the router Deployment does not exist yet"
    status = deployment.get("status") or {}
    available = int(status.get("availableReplicas") or 0)
    wanted = (deployment.get("spec") or {}).get("replicas", 1)
    return available >= 1, f"router {available}/{wanted} available"


def _condition(obj: dict[str, Any], kind: str) -> dict[str, Any] | None:
    for cond in obj.get("status", {}).get("conditions") or []:
        if cond.get("type") == kind:
            return dict(cond)
    return None


def _exit(terminated: dict[str, Any]) -> str:
    return f"exit code {terminated.get('exitCode')}: {terminated.get('message') or ''}"


# A replica whose pod the apiserver refused to create (admission: a missing
# PriorityClass, a quota); the message is the apiserver's.
POD_REFUSED: Final = "PodCreateRefused"


def pod_facts(pod: dict[str, Any]) -> PodFacts:
    meta, status = pod["metadata"], pod.get("status") or {}
    ready = (_condition(pod, "Ready") or {}).get("status") == "True"
    view = PodView(
        name=meta["name"],
        index=int(meta["labels"][b.REPLICA_LABEL]),
        spec_hash=(meta.get("annotations") or {}).get(b.SPEC_HASH, ""),
        ready=ready,
        deleting=bool(meta.get("deletionTimestamp")),
    )
    reason = message = None
    scheduled = _condition(pod, "PodScheduled")
    if scheduled and scheduled.get("status") == "False":
        reason, message = scheduled.get("reason") or "Unschedulable", scheduled.get("message")
    # A node-local replica's fetch (an init container) first: a failure there is why
    # its worker never starts.
    statuses = [
        *(status.get("initContainerStatuses") or []),
        *(status.get("containerStatuses") or []),
    ]
    for cs in statuses:
        state = cs.get("state") or {}
        waiting, terminated = state.get("waiting") or {}, state.get("terminated") or {}
        last = (cs.get("lastState") or {}).get("terminated") or {}
        if waiting.get("reason") in _BAD_WAITING:
            # Backing off after a crash: the crash says why, the back-off only when.
            reason = waiting["reason"]
            message = _exit(last) if last.get("exitCode") else waiting.get("message")
        elif terminated and terminated.get("exitCode", 0) != 0:
            reason = terminated.get("reason") or "Error"
            message = _exit(terminated)
    phase = status.get("phase") or "Pending"
    if phase == "Pending" and _fetching(status):
        phase = "FetchingModel"
    return PodFacts(
        view=view,
        phase=phase,
        node=(pod.get("spec") or {}).get("nodeName"),
        reason=reason,
        message=(message or "").strip() or None,
        ip=status.get("podIP") or None,
    )


def _fetching(status: Mapping[str, Any]) -> bool:
    """A node-local replica's init container fetches its model: it has not exited 0 yet
    (it runs, starts, or waits to try again)."""
    for cs in status.get("initContainerStatuses") or []:
        if cs.get("name") == b.FETCH_CONTAINER:
            return ((cs.get("state") or {}).get("terminated") or {}).get("exitCode") != 0
    return False


def _unsynced(facts: PodFacts, port: int, state: SyncReports) -> Unsynced | None:
    # Routers follow Ready pods only; an entry for another pod is stale.
    if not facts.view.ready or not facts.ip or not state.out_of_sync:
        return None
    try:
        return state.out_of_sync.get(replica_endpoint(facts.ip, port, 0))
    except LayoutError:
        return None


def _now() -> str:
    return datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def _conditions(
    previous: list[dict[str, Any]], wanted: list[tuple[str, str, str, str]], generation: int
) -> list[Condition]:
    """Conditions with lastTransitionTime kept while their status does not change."""
    before = {c.get("type"): c for c in previous}
    out = []
    for kind, state, reason, message in wanted:
        old = before.get(kind) or {}
        since = old.get("lastTransitionTime") if old.get("status") == state else None
        out.append(
            Condition(
                type=kind,
                status=state,
                reason=reason,
                message=message,
                observedGeneration=generation,
                lastTransitionTime=since or _now(),
            )
        )
    return out


def available_condition(
    ready: int, budget: int, replicas: int, routed: bool, router_says: str
) -> tuple[str, str, str]:
    """The Available condition (status, reason, message), a Deployment's in meaning:
    the service serves with no more replicas down than its disruption budget allows
    (``budget``, the PodDisruptionBudget's maxUnavailable, which a drain or a roll may
    take), at least one, and a router available. Ready asks for every replica, so it
    goes False during a drain; Available stays True through one."""
    needed = max(1, replicas - budget)
    counted = f"{ready}/{replicas} replicas ready, {needed} needed"
    if ready < needed:
        return "False", "MinimumReplicasUnavailable", f"{counted}; {router_says}"
    if not routed:
        return "False", "RouterNotAvailable", f"{counted}; {router_says}"
    return "True", "MinimumReplicasAvailable", f"{counted}; {router_says}"


def compute_status(
    svc: b.Svc,
    pods: list[dict[str, Any]],
    previous: dict[str, Any],
    router: Mapping[str, Any] | None = None,
    control: SyncReports | None = None,
    model: ModelStep | None = None,
    refused: Mapping[int, str] | None = None,
) -> dict[str, Any]:
    """The status subresource, as the schema declares it.

    ``router`` is the router Deployment as read (None: absent), ``control`` what the
    routers report in the control-state ConfigMap, ``model`` where model.source stands
    (None: as for a model in place), ``refused`` the replicas whose pod create the
    apiserver refused, with its message. A replica counts as ready when its pod is Ready
    and no router reports it out of sync: only then does it serve.
    """
    spec, current = svc.spec, svc.pod_hash
    held = model is not None and model.fetched_path is None
    control = control or SyncReports()
    facts = sorted((pod_facts(p) for p in pods), key=lambda f: f.view.index)
    lag = {f.view.index: u for f in facts if (u := _unsynced(f, spec.schedulerPort, control))}
    desired = [f for f in facts if f.view.index < spec.replicas and not f.view.deleting]
    serving = {f.view.index for f in facts if f.view.ready and f.view.index not in lag}
    ready = sum(1 for f in desired if f.view.index in serving)
    updated = sum(1 for f in desired if f.view.spec_hash == current)
    troubled = [f for f in facts if f.reason is not None]
    refused = dict(refused or {})
    settled = (
        len(desired) == spec.replicas and updated == spec.replicas and len(facts) == spec.replicas
    )
    routed, router_says = router_available(router)
    counted = f"{ready}/{spec.replicas} replicas ready"
    if ready < spec.replicas and held:
        waiting = f"{counted}; replicas wait for the model (see ModelReady)"
        ready_condition = ("False", "WaitingForModel", f"{waiting}; {router_says}")
    elif ready < spec.replicas:
        ready_condition = ("False", "ReplicasNotReady", f"{counted}; {router_says}")
    elif not routed:
        ready_condition = ("False", "RouterNotAvailable", f"{counted}; {router_says}")
    else:
        ready_condition = ("True", "AllReplicasReady", f"{counted}; {router_says}")
    budget = b.pdb_max_unavailable(spec)
    available = available_condition(ready, budget, spec.replicas, routed, router_says)
    wanted = [
        ("Ready", *ready_condition),
        ("Available", *available),
        (
            "Progressing",
            "False" if settled else "True",
            "Stable" if settled else ("RollingUpdate" if updated < len(desired) else "Scaling"),
            f"{updated}/{spec.replicas} replicas on the current spec, {len(facts)} pods exist",
        ),
    ]
    if troubled or refused:
        problems = [
            *(
                (f.reason or "ReplicaFailing", f"{f.view.name}: {f.reason}: {f.message or ''}")
                for f in troubled
            ),
            *(
                (POD_REFUSED, f"{b.replica_pod_name(svc, i)}: {POD_REFUSED}: {m}")
                for i, m in sorted(refused.items())
            ),
        ]
        detail = "; ".join(text.rstrip(": ") for _, text in problems)
        wanted.append(("Degraded", "True", problems[0][0], detail))
    else:
        wanted.append(("Degraded", "False", "AsExpected", "no replica reports a problem"))
    if control.problem is not None:
        wanted.append(("ControlStateSynced", "Unknown", "ControlStateUnreadable", control.problem))
    elif lag:
        detail = "; ".join(f"replica {i}: {u.describe()}" for i, u in sorted(lag.items()))
        wanted.append(("ControlStateSynced", "False", "OutOfSync", detail))
    else:
        wanted.append(
            ("ControlStateSynced", "True", "InSync", "no router reports a replica out of sync")
        )
    if model is not None:
        wanted.append(("ModelReady", *model.condition))
    present = {f.view.index for f in facts}
    entries = [
        ReplicaStatus(
            index=f.view.index,
            pod=f.view.name,
            phase="Terminating" if f.view.deleting else f.phase,
            ready=f.view.index in serving,
            updated=f.view.spec_hash == current,
            node=f.node,
            # For a Ready pod, being out of sync is what keeps it from serving.
            reason="OutOfSync" if f.view.index in lag else f.reason,
            message=lag[f.view.index].describe() if f.view.index in lag else f.message,
        )
        for f in facts
    ]
    # A desired replica without a pod is listed too: the next reconcile knows (from this
    # status) that creating it replaces a pod rather than adding one.
    entries += [
        ReplicaStatus(
            index=i,
            pod=b.replica_pod_name(svc, i),
            phase="WaitingForModel" if held else "Missing",
            ready=False,
            updated=False,
            reason=POD_REFUSED if i in refused else None,
            message=refused.get(i),
        )
        for i in range(spec.replicas)
        if i not in present
    ]
    par = spec.parallelism
    status = DiffusionServiceStatus(
        replicas=len(desired),
        readyReplicas=ready,
        updatedReplicas=updated,
        ready=f"{ready}/{spec.replicas}",
        parallel=f"tp{par.tp}-sp{par.sp}-cfg{par.cfg}",
        selector=b.selector_string(svc),
        observedGeneration=svc.generation,
        endpoint=f"http://{svc.name}.{svc.namespace}.svc:{spec.router.service.port}",
        model=model.status if model is not None else None,
        replicaStatuses=sorted(entries, key=lambda r: r.index),
        conditions=_conditions(previous.get("conditions") or [], wanted, svc.generation),
    )
    out = status.model_dump(mode="json", exclude_none=True)
    if model is not None:
        # A merge patch keeps keys it does not name: spell the absent ones out as null
        # (a finished fetch's progress, a dropped source) so they go.
        out["model"] = model.status.model_dump(mode="json") if model.status else None
    return out


def known_indices(previous: Mapping[str, Any]) -> set[int]:
    """Replica indices the last written status listed, present or missing."""
    return {
        int(r["index"])
        for r in previous.get("replicaStatuses") or []
        if isinstance(r, dict)
        and isinstance(r.get("index"), int)
        and r.get("phase") != "WaitingForModel"  # listed, never made
    }
