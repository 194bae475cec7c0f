"""Where model.source stands, from what the operator read: the last status, the fill
Job, its newest pod and that pod's last log line. Pure, so tested on dicts.

The replicas load the entry recorded in ``status.model.loaded``. It changes only when
a fill pod for the spec's source has exited 0 (or its Job has completed) and the pod's
termination message names the published folder; until then replicas keep loading the previous entry
(a deleted replica comes back on it), or, with none yet, are held back: no pod asks
for GPUs while its model is on the way.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Final

from pydantic import ValidationError

from dpserve.operator import builders as b
from dpserve.operator import fill_job as f
from dpserve.operator.plan import Note
from dpserve.operator.spec import LoadedModel, ModelFetch, ModelStatus
from dpserve.sources.plan import human_bytes

ConditionTuple = tuple[str, str, str]  # status, reason, message
MESSAGE_MAX: Final = 1000


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
    return step


def prune_due(svc: b.Svc, step: ModelStep, status: Mapping[str, Any]) -> str | None:
    """The loaded folder, when every replica runs on it and the cache was not pruned
    since it was loaded: time for the clean-up Job (``status``: as just computed)."""
    model, replicas = svc.spec.model, svc.spec.replicas
    loaded = step.status.loaded if step.status else None
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
        if outcome is None or outcome.get("state") != "ready" or not outcome.get("folder"):
            # Its pod (and the outcome) went with the Job's history: ask again. The entry
            # is published, so the new Job only confirms it and moves nothing.
            return pending("confirming the fetched entry", delete=True)
        new = LoadedModel(
            source=model.source,
            revision=str(outcome.get("revision") or "?"),
            path=str(outcome["folder"]),
            claim=model.cache.claimName,
            bytes=_int(outcome.get("bytes_total")),
        )
        note = Note("FetchFinished", f"fetched {_describe(new)}")
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
    return (
        loaded.source == model.source
        and loaded.claim == model.cache.claimName
        and loaded.path.startswith(model.mountPath.rstrip("/") + "/")
    )


def _describe(loaded: LoadedModel) -> str:
    size = f", {human_bytes(loaded.bytes)}" if loaded.bytes is not None else ""
    return f"{loaded.source} at {loaded.revision}{size}, in claim {loaded.claim} at {loaded.path}"


def _finished(job: Mapping[str, Any], kind: str) -> bool:
    conditions = (job.get("status") or {}).get("conditions") or []
    return any(c.get("type") == kind and c.get("status") == "True" for c in conditions)


def _fetch_state(pod: Mapping[str, Any] | None) -> Mapping[str, Any]:
    for cs in ((pod or {}).get("status") or {}).get("containerStatuses") or []:
        if cs.get("name") == f.CONTAINER:
            return cs.get("state") or {}
    return {}


def _published(pod: Mapping[str, Any] | None, outcome: Mapping[str, Any] | None) -> bool:
    exited = (_fetch_state(pod).get("terminated") or {}).get("exitCode")
    return exited == 0 and outcome is not None and outcome.get("state") == "ready"


def _outcome(pod: Mapping[str, Any] | None) -> dict[str, Any] | None:
    """The JSON result ``dpserve fetch --result-file`` left as the termination message."""
    message = (_fetch_state(pod).get("terminated") or {}).get("message") or ""
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


def _running(source: str, job: str, facts: FillFacts) -> ModelFetch:
    snap = _last_progress(facts.log_tail)
    waiting = _fetch_state(facts.pod).get("waiting") or {}
    if snap is None:
        why = waiting.get("reason")
        message = f"{why}: {waiting.get('message') or ''}".rstrip(": ") if why else None
        return ModelFetch(source=source, job=job, state="Pending", message=message)
    return ModelFetch(
        source=source,
        job=job,
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
