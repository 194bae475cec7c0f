"""Status of a DiffusionService, computed from its pods: pure, so tested on dicts."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any, Final

from dpserve.operator import builders as b
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


def _condition(obj: dict[str, Any], kind: str) -> dict[str, Any] | None:
    for cond in obj.get("status", {}).get("conditions") or []:
        if cond.get("type") == kind:
            return dict(cond)
    return None


def _exit(terminated: dict[str, Any]) -> str:
    return f"exit code {terminated.get('exitCode')}: {terminated.get('message') or ''}"


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
    for cs in status.get("containerStatuses") or []:
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
    return PodFacts(
        view=view,
        phase=status.get("phase") or "Pending",
        node=(pod.get("spec") or {}).get("nodeName"),
        reason=reason,
        message=(message or "").strip() or None,
    )


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


def compute_status(
    svc: b.Svc,
    pods: list[dict[str, Any]],
    previous: dict[str, Any],
    invalid: str | None = None,
) -> dict[str, Any]:
    """The status subresource, as the schema declares it."""
    spec, current = svc.spec, b.spec_hash(svc.spec)
    facts = sorted((pod_facts(p) for p in pods), key=lambda f: f.view.index)
    desired = [f for f in facts if f.view.index < spec.replicas and not f.view.deleting]
    ready = sum(1 for f in desired if f.view.ready)
    updated = sum(1 for f in desired if f.view.spec_hash == current)
    troubled = [f for f in facts if f.reason is not None]
    settled = (
        len(desired) == spec.replicas and updated == spec.replicas and len(facts) == spec.replicas
    )
    par = spec.parallelism
    wanted = [
        (
            "Ready",
            "True" if ready >= spec.replicas else "False",
            "AllReplicasReady" if ready >= spec.replicas else "ReplicasNotReady",
            f"{ready}/{spec.replicas} replicas ready",
        ),
        (
            "Progressing",
            "False" if settled else "True",
            "Stable" if settled else ("RollingUpdate" if updated < len(desired) else "Scaling"),
            f"{updated}/{spec.replicas} replicas on the current spec, {len(facts)} pods exist",
        ),
    ]
    if invalid is not None:
        wanted.append(("Degraded", "True", "InvalidSpec", invalid))
    elif troubled:
        first = troubled[0]
        detail = "; ".join(
            f"{f.view.name}: {f.reason}: {f.message or ''}".rstrip(": ") for f in troubled
        )
        wanted.append(("Degraded", "True", first.reason or "ReplicaFailing", detail))
    else:
        wanted.append(("Degraded", "False", "AsExpected", "no replica reports a problem"))
    status = DiffusionServiceStatus(
        replicas=len(desired),
        readyReplicas=ready,
        updatedReplicas=updated,
        ready=f"{ready}/{spec.replicas}",
        parallel=f"tp{par.tp}-sp{par.sp}-cfg{par.cfg}",
        selector=b.selector_string(svc),
        observedGeneration=svc.generation,
        endpoint=f"http://{svc.name}.{svc.namespace}.svc:{spec.router.service.port}",
        replicaStatuses=[
            ReplicaStatus(
                index=f.view.index,
                pod=f.view.name,
                phase="Terminating" if f.view.deleting else f.phase,
                ready=f.view.ready,
                updated=f.view.spec_hash == current,
                node=f.node,
                reason=f.reason,
                message=f.message,
            )
            for f in facts
        ],
        conditions=_conditions(previous.get("conditions") or [], wanted, svc.generation),
    )
    return status.model_dump(mode="json", exclude_none=True)
