"""Where model.source stands, from what the operator read: the last status, the fill
Job, its newest pod and that pod's last log line. Pure, so tested on dicts.

The replicas load the entry recorded in ``status.model.loaded``. It changes only when
a fill pod for the spec's source has exited 0 (or its Job has completed) and the pod's
termination message names the published folder; until then replicas keep loading the previous entry
(a deleted replica comes back on it), or, with none yet, are held back: no pod asks
for GPUs while its model is on the way.

With a node-local cache the Job only pins the revision (``dpserve fetch --pin``): its
outcome is loaded at once, and each replica's init container fetches it into its
node's folder. ``node_step`` then reads those init containers: ModelReady stays
Fetching until every replica is past its fetch.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Final

from pydantic import ValidationError

from dpserve.operator import builders as b
from dpserve.operator import fill_job as f
from dpserve.operator.plan import Note
from dpserve.operator.spec import LoadedModel, ModelFetch, ModelStatus
from dpserve.sources.plan import human_bytes
from dpserve.sources.uri import HubSource, parse

ConditionTuple = tuple[str, str, str]  # status, reason, message
MESSAGE_MAX: Final = 1000
# A fill's outcome once its entry is published, and a pin's (node-local: nothing moved).
DONE: Final = frozenset({"ready", "pinned"})


@dataclass(frozen=True)
class FillFacts:
    """The fill Job of the spec's source as read (None: absent), its newest pod, and the
    last lines of that pod's log (stdout and stderr mixed; None: not read)."""

    job: Mapping[str, Any] | None = None
    pod: Mapping[str, Any] | None = None
    log_tail: str | None = None


@dataclass(frozen=True)
class ModelStep:
    fetched_path: str | None  # what replicas load; None: hold them back
    status: ModelStatus | None  # status.model (None without a source)
    condition: ConditionTuple  # the ModelReady condition
    create_job: bool = False
    delete_job: bool = False  # finished, but its outcome is gone: make it again
    notes: list[tuple[str, Note]] = field(default_factory=list)  # (Normal|Warning, note)
    node_fetch: b.NodeFetch | None = None  # node-local: what replicas' init containers fetch


def previous_model(previous_status: Mapping[str, Any]) -> ModelStatus | None:
    """status.model as last written; an unreadable one counts as none (never raises)."""
    raw = previous_status.get("model")
    if not isinstance(raw, dict):
        return None
    try:
        return ModelStatus.model_validate(raw)
    except ValidationError:
        return None


def needs_fill(svc: b.Svc, previous: ModelStatus | None) -> bool:
    """model.source is set and its entry is not the loaded one: its fill Job is read."""
    model = svc.spec.model
    if model.source is None or model.cache is None:
        return False
    loaded = previous.loaded if previous else None
    return loaded is None or not _matches(svc, loaded)


def model_step(svc: b.Svc, previous: ModelStatus | None, facts: FillFacts) -> ModelStep:
    step = _step(svc, previous, facts)
    if step.status is not None and previous is not None:
        step.status.pruned = previous.pruned  # the clean-up's own record, kept
    loaded = step.status.loaded if step.status else None
    if loaded is not None and loaded.nodeLocal is not None and step.fetched_path == loaded.path:
        step = dataclasses.replace(step, node_fetch=pinned_fetch(loaded))
    return step


def pinned_fetch(loaded: LoadedModel) -> b.NodeFetch:
    """The loaded entry's source at its revision: a hub source names its commit."""
    source = parse(loaded.source)
    if isinstance(source, HubSource):
        source = HubSource(source.repo_id, loaded.revision)
    return b.NodeFetch(uri=str(source), revision=loaded.revision)


def prune_due(svc: b.Svc, step: ModelStep, status: Mapping[str, Any]) -> str | None:
    """The loaded folder, when every replica runs on it and the cache was not pruned
    since it was loaded: time for the clean-up Job (``status``: as just computed)."""
    model, replicas = svc.spec.model, svc.spec.replicas
    loaded = step.status.loaded if step.status else None
    if model.cache is None or model.cache.claimName is None:
        return None  # no claim (node-local: each replica's fetch prunes its node)
    if model.source is None or loaded is None or step.status is None or step.status.fetch:
        return None  # nothing loaded yet, or a fetch under way (its roll comes next)
    rolled = status.get("updatedReplicas") == replicas == status.get("readyReplicas")
    done = (
        rolled
        and step.fetched_path == loaded.path
        and len(status.get("replicaStatuses") or []) == replicas
    )  # no outdated pod left
    return loaded.path if done and step.status.pruned != loaded.path else None


def _step(svc: b.Svc, previous: ModelStatus | None, facts: FillFacts) -> ModelStep:
    model = svc.spec.model
    if model.source is None or model.cache is None:
        where = model.path or "?"
        return ModelStep(
            fetched_path=where,
            status=None,
            condition=("True", "ModelInPlace", f"replicas load {where} (a volume or the image)"),
        )
    loaded = previous.loaded if previous else None
    if loaded is not None and _matches(svc, loaded):
        return ModelStep(
            fetched_path=loaded.path,
            status=ModelStatus(loaded=loaded, progress="Ready"),
            condition=("True", "Fetched", _describe(loaded)),
        )
    job_name = f.fill_job_name(svc)
    meanwhile = (
        f"; replicas load {loaded.source} meanwhile"
        if loaded is not None
        else "; replicas wait for it"
    )
    old_path = loaded.path if loaded is not None else None

    def pending(why: str, create: bool = False, delete: bool = False) -> ModelStep:
        fetch = ModelFetch(source=str(model.source), job=job_name, state="Pending")
        return ModelStep(
            fetched_path=old_path,
            status=ModelStatus(loaded=loaded, fetch=fetch, progress="Pending"),
            condition=("False", "FetchPending", f"{why}{meanwhile}"),
            create_job=create,
            delete_job=delete,
        )

    if facts.job is None:
        return pending(f"starting the fill Job {job_name}", create=True)
    outcome = _outcome(facts.pod)
    # The fetch's own word, once its pod has exited 0, is enough: the entry is published
    # before it writes the result. The Job is marked Complete a second or more later (its
    # controller batches pod updates), and the operator hears of that only at the next
    # drift check: waiting for it would show a finished fill as Pending meanwhile.
    if _finished(facts.job, "Complete") or _published(facts.pod, outcome):
        if outcome is None or outcome.get("state") not in DONE or not outcome.get("folder"):
            # Its pod (and the outcome) went with the Job's history: ask again. The entry
            # is published, so the new Job only confirms it and moves nothing.
            return pending("confirming the fetched entry", delete=True)
        node = model.cache.nodeLocal
        new = LoadedModel(
            source=model.source,
            revision=str(outcome.get("revision") or "?"),
            path=str(outcome["folder"]),
            claim=model.cache.claimName,
            nodeLocal=node.path if node is not None else None,
            bytes=_int(outcome.get("bytes_total")),
        )
        note = (
            Note("FetchPinned", f"pinned {_describe(new)}; each node fetches it once")
            if node is not None
            else Note("FetchFinished", f"fetched {_describe(new)}")
        )
        return ModelStep(
            fetched_path=new.path,
            status=ModelStatus(loaded=new, progress="Ready"),
            condition=("True", "Fetched", _describe(new)),
            notes=[("Normal", note)],
        )
    if _finished(facts.job, "Failed"):
        error = _failure(facts.job, outcome)
        fetch = ModelFetch(source=model.source, job=job_name, state="Failed", message=error)
        was = previous.fetch if previous else None
        notes = []
        if was is None or was.state != "Failed" or was.job != job_name:
            notes.append(("Warning", Note("FetchFailed", f"{model.source}: {error}")))
        retry = f" (delete Job {job_name} to try again)"
        return ModelStep(
            fetched_path=old_path,
            status=ModelStatus(loaded=loaded, fetch=fetch, progress="Failed"),
            condition=("False", "FetchFailed", _clip(f"{error}{retry}{meanwhile}")),
            notes=notes,
        )
    fetch = _running(model.source, job_name, facts)
    line = _progress_line(fetch)
    return ModelStep(
        fetched_path=old_path,
        status=ModelStatus(loaded=loaded, fetch=fetch, progress=line),
        condition=("False", "Fetching" if fetch.state == "Fetching" else "FetchPending",
                   _clip(f"{model.source}: {fetch.message or line}{meanwhile}")),
    )  # fmt: skip


def _matches(svc: b.Svc, loaded: LoadedModel) -> bool:
    model = svc.spec.model
    assert model.cache is not None
    node = model.cache.nodeLocal
    return (
        loaded.source == model.source
        and loaded.claim == model.cache.claimName
        and loaded.nodeLocal == (node.path if node is not None else None)
        and loaded.path.startswith(model.mountPath.rstrip("/") + "/")
    )


def _describe(loaded: LoadedModel) -> str:
    size = f", {human_bytes(loaded.bytes)}" if loaded.bytes is not None else ""
    where = f"claim {loaded.claim}" if loaded.claim else f"each node's {loaded.nodeLocal}"
    return f"{loaded.source} at {loaded.revision}{size}, in {where} at {loaded.path}"


def _finished(job: Mapping[str, Any], kind: str) -> bool:
    conditions = (job.get("status") or {}).get("conditions") or []
    return any(c.get("type") == kind and c.get("status") == "True" for c in conditions)


def _fetch_state(pod: Mapping[str, Any] | None, key: str = "containerStatuses") -> dict[str, Any]:
    """The fetch container's state (``key``: initContainerStatuses for a replica's); one
    waiting to start again after a failure shows that failure (its last state)."""
    for cs in ((pod or {}).get("status") or {}).get(key) or []:
        if cs.get("name") == f.CONTAINER:
            state = dict(cs.get("state") or {})
            last = (cs.get("lastState") or {}).get("terminated")
            if "waiting" in state and last:
                state["terminated"] = last
            return state
    return {}


def _published(pod: Mapping[str, Any] | None, outcome: Mapping[str, Any] | None) -> bool:
    exited = (_fetch_state(pod).get("terminated") or {}).get("exitCode")
    return exited == 0 and outcome is not None and outcome.get("state") in DONE


def _outcome(
    pod: Mapping[str, Any] | None, key: str = "containerStatuses"
) -> dict[str, Any] | None:
    """The JSON result ``dpserve fetch --result-file`` left as the termination message."""
    message = (_fetch_state(pod, key).get("terminated") or {}).get("message") or ""
    try:
        found = json.loads(message)
    except ValueError:
        return None
    return found if isinstance(found, dict) else None


def _failure(job: Mapping[str, Any], outcome: dict[str, Any] | None) -> str:
    if outcome is not None and outcome.get("error"):
        return _clip(str(outcome["error"]))
    for c in (job.get("status") or {}).get("conditions") or []:
        if c.get("type") == "Failed" and c.get("status") == "True":
            return _clip(f"{c.get('reason') or 'Failed'}: {c.get('message') or ''}".rstrip(": "))
    return "the fill Job failed"


def _running(
    source: str,
    job: str | None,
    facts: FillFacts,
    key: str = "containerStatuses",
    pod: str | None = None,
) -> ModelFetch:
    snap = _last_progress(facts.log_tail)
    waiting = _fetch_state(facts.pod, key).get("waiting") or {}
    if snap is None:
        why = waiting.get("reason")
        message = f"{why}: {waiting.get('message') or ''}".rstrip(": ") if why else None
        return ModelFetch(source=source, job=job, pod=pod, state="Pending", message=message)
    return ModelFetch(
        source=source,
        job=job,
        pod=pod,
        state="Fetching",
        revision=str(snap.get("revision") or "") or None,
        bytesDone=_int(snap.get("bytes_done")),
        bytesTotal=_int(snap.get("bytes_total")),
        bytesPerSecond=_int(snap.get("rate_bytes_per_s")),
        etaSeconds=_int(snap.get("eta_s")),
    )


def _last_progress(log_tail: str | None) -> Mapping[str, Any] | None:
    """The newest progress line ``dpserve fetch --json-lines`` printed; its log lines
    (on stderr) come between them."""
    for line in reversed((log_tail or "").splitlines()):
        try:
            found = json.loads(line)
        except ValueError:
            continue
        if isinstance(found, dict) and found.get("event") == "progress":
            return found
    return None


def _progress_line(fetch: ModelFetch) -> str:
    if fetch.state != "Fetching" or fetch.bytesTotal is None or fetch.bytesDone is None:
        return "Pending"
    share = 1.0 if fetch.bytesTotal == 0 else min(1.0, fetch.bytesDone / fetch.bytesTotal)
    rate = f", {human_bytes(fetch.bytesPerSecond)}/s" if fetch.bytesPerSecond else ""
    eta = fetch.etaSeconds
    left = f", {eta // 60}m{eta % 60:02d}s left" if eta is not None else ""
    return (
        f"Fetching {share:.0%} ({human_bytes(fetch.bytesDone)} of "
        f"{human_bytes(fetch.bytesTotal)}){rate}{left}"
    )


def _int(value: Any) -> int | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return int(value)


def _clip(text: str) -> str:
    return text if len(text) <= MESSAGE_MAX else text[: MESSAGE_MAX - 1] + "…"


# ------------------------------------------------------------ node-local fetches

INIT: Final = "initContainerStatuses"


def current_replicas(svc: b.Svc, pods: Sequence[Mapping[str, Any]]) -> dict[int, Mapping[str, Any]]:
    """The replica pods on the current spec (so on the pinned entry), by index."""
    found = {}
    for pod in pods:
        meta = pod.get("metadata") or {}
        hashed = (meta.get("annotations") or {}).get(b.SPEC_HASH)
        if hashed == svc.pod_hash and not meta.get("deletionTimestamp"):
            found[int((meta.get("labels") or {})[b.REPLICA_LABEL])] = pod
    return found


def fetching_now(svc: b.Svc, pods: Sequence[Mapping[str, Any]]) -> list[str]:
    """Node-local: the replica pods whose fetch runs now, whose logs are worth reading."""
    if svc.node_fetch is None:
        return []
    return [
        str(pod["metadata"]["name"])
        for pod in current_replicas(svc, pods).values()
        if "running" in _fetch_state(pod, INIT)
    ]


def node_step(
    svc: b.Svc,
    step: ModelStep,
    previous: ModelStatus | None,
    pods: Sequence[Mapping[str, Any]],
    log_tails: Mapping[str, str | None],
) -> ModelStep:
    """Node-local, once pinned: where the replicas' fetches into their nodes stand, from
    their init containers (``log_tails``: by pod name, from ``fetching_now``). Any other
    step (a claim, or a pin under way) is returned as it is."""
    status = step.status
    if step.node_fetch is None or status is None or status.fetch or status.loaded is None:
        return step
    loaded, by_index = status.loaded, current_replicas(svc, pods)
    fetches = [
        _replica_fetch(loaded.source, b.replica_pod_name(svc, i), by_index.get(i), log_tails)
        for i in range(svc.spec.replicas)
    ]
    waiting = [x for x in fetches if x is not None]
    was = previous.fetch if previous else None
    base = ModelStatus(loaded=loaded, pruned=status.pruned)
    if not waiting:
        notes = []
        if was is not None:
            notes.append(("Normal", Note("FetchFinished", f"every replica's node holds "
                                         f"{_describe(loaded)}")))  # fmt: skip
        return dataclasses.replace(
            step,
            status=base.model_copy(update={"progress": "Ready"}),
            condition=("True", "Fetched", f"{_describe(loaded)}; on every replica's node"),
            notes=[*step.notes, *notes],
        )
    failed = next((x for x in waiting if x.state == "Failed"), None)
    if failed is not None:
        notes = []
        if was is None or was.state != "Failed" or was.pod != failed.pod:
            warning = Note("FetchFailed", f"{failed.pod}: {loaded.source}: {failed.message}")
            notes.append(("Warning", warning))
        return dataclasses.replace(
            step,
            status=base.model_copy(update={"fetch": failed, "progress": "Failed"}),
            condition=("False", "FetchFailed", _clip(f"{failed.pod}: {failed.message}")),
            notes=[*step.notes, *notes],
        )
    shown = next((x for x in waiting if x.state == "Fetching"), waiting[0])
    line = _progress_line(shown)
    past = len(fetches) - len(waiting)
    detail = f"{shown.pod}: {shown.message or line}; {past}/{len(fetches)} replicas fetched"
    reason = "Fetching" if shown.state == "Fetching" else "FetchPending"
    return dataclasses.replace(
        step,
        status=base.model_copy(update={"fetch": shown, "progress": line}),
        condition=("False", reason, _clip(f"{loaded.source} at {loaded.revision}: {detail}")),
    )


def _replica_fetch(
    source: str, name: str, pod: Mapping[str, Any] | None, log_tails: Mapping[str, str | None]
) -> ModelFetch | None:
    """One replica's fetch; None once it is past it (its worker started)."""
    if pod is None:
        why = "not made yet (a roll replaces the replicas in turn)"
        return ModelFetch(source=source, pod=name, state="Pending", message=why)
    state = _fetch_state(pod, INIT)
    done = (state.get("terminated") or {}).get("exitCode") == 0 and len(state) == 1
    if done or (pod.get("status") or {}).get("phase") in ("Running", "Succeeded"):
        return None
    outcome = _outcome(pod, INIT)
    if outcome is not None and outcome.get("state") == "failed":
        error = _clip(str(outcome.get("error") or "the fetch failed"))
        if not outcome.get("retried"):
            return ModelFetch(source=source, pod=name, state="Failed", message=error)
        if "running" not in state:  # waiting to try again
            return ModelFetch(
                source=source, pod=name, state="Pending", message=f"tries again: {error}"
            )
    facts = FillFacts(pod=pod, log_tail=log_tails.get(name))
    return _running(source, None, facts, INIT, name)
