"""The replica planner: given the spec and the pods that exist, what to create and delete.

Pure, level-based: it looks only at the present state, so running it again after
a crash, a missed event or a conflict converges to the same place.

Rolling replacement with stable pod names: a pod cannot be replaced in place, so
an outdated pod is deleted and recreated under its name once gone. ``maxUnavailable``
bounds how many of the desired replicas may be missing or unready at once;
``maxSurge`` allows extra pods, at indices past ``replicas`` and only while a roll
runs, that serve while the originals are replaced (so the GPU count never exceeds
``replicas + maxSurge``) and leave once losing them keeps the budget. Each
replacement is Ready before the budget lets the next one go.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass


@dataclass(frozen=True)
class PodView:
    """What the planner needs to know about one replica pod."""

    name: str
    index: int
    spec_hash: str
    ready: bool
    deleting: bool


@dataclass(frozen=True)
class Plan:
    create: tuple[int, ...]  # indices to create with the current spec
    delete: tuple[str, ...]  # pod names to delete

    @property
    def empty(self) -> bool:
        return not self.create and not self.delete


def plan(
    replicas: int, current_hash: str, max_unavailable: int, max_surge: int, pods: list[PodView]
) -> Plan:
    by_index = {p.index: p for p in pods}
    outdated = [
        p for p in pods if p.index < replicas and p.spec_hash != current_hash and not p.deleting
    ]
    rolling = bool(outdated)
    delete: list[str] = []
    create: list[int] = []

    # Scale down (highest indices: everything past `replicas`), except surge pods.
    surge: list[PodView] = []
    for pod in sorted(pods, key=lambda p: -p.index):
        if pod.index < replicas or pod.deleting:
            continue
        if pod.index < replicas + max_surge:
            surge.append(pod)
        else:
            delete.append(pod.name)

    # Missing replicas (never created, or gone after a delete) come back at once.
    create += [i for i in range(replicas) if i not in by_index]
    if rolling:
        create += [i for i in range(replicas, replicas + max_surge) if i not in by_index]

    leaving = set(delete)
    available = sum(1 for p in pods if p.ready and not p.deleting and p.name not in leaving)
    floor = replicas - max_unavailable
    # Once nothing is outdated a surge pod is excess, but one that serves stays until the
    # replacements are ready enough that losing it keeps `floor` replicas available.
    if not rolling:
        for pod in surge:
            if pod.ready and pod.spec_hash == current_hash:
                if available - 1 < floor:
                    continue
                available -= 1
            delete.append(pod.name)

    # Replace outdated pods while enough replicas stay available.
    for pod in sorted(outdated, key=lambda p: (p.ready, -p.index)):
        if pod.ready:
            if available - 1 < floor:
                break
            available -= 1
        delete.append(pod.name)
    return Plan(create=tuple(create), delete=tuple(delete))


@dataclass(frozen=True)
class Note:
    """Why an action was taken: the reason and message of the Event recorded for it."""

    reason: str
    message: str


def why_delete(pod: PodView, replicas: int) -> Note:
    if pod.index >= replicas:
        return Note(
            "ReplicaDeleted",
            f"deleted pod {pod.name}: replica {pod.index} is past the {replicas} desired"
            " (scaled down, or a surge pod no longer needed)",
        )
    return Note(
        "ReplicaRolled",
        f"deleted pod {pod.name} (replica {pod.index}), which runs an outdated spec;"
        " it is recreated on the current one",
    )


def why_create(index: int, name: str, replicas: int, known: Collection[int]) -> Note:
    """``known``: the indices the last written status listed (present or missing).

    A known index being created again is a replacement (after a roll step or a lost
    pod); an unknown one is new (a new service, a scale-up, a surge pod).
    """
    if index in known:
        return Note("ReplicaReplaced", f"recreated pod {name} (replica {index})")
    surge = " as a surge pod while the roll runs" if index >= replicas else ""
    return Note("ReplicaCreated", f"created pod {name} (replica {index}){surge}")
