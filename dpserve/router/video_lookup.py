"""Finding any video job from any router, listing and deleting them: the lookup side
of the video jobs (dpserve/router/videos.py places and watches them; this reads its
watches).

**Find.** Nothing about a job lives only in a router, so any router finds any job:
it asks the replica it watches the job on, then the owner the id names, and then
every answering replica at once (a re-run lives elsewhere under the same id); the
copy with the highest ``attempt`` wins. Then this router's own watch of it (a job
waiting for a replica), then the job's record in the bucket output store, if there
is one (dpserve/router/job_records.py: its router and replica may both be gone).
List, and delete, ask every answering replica (and the store).

**Own.** A job belongs to the tenant that submitted it: the replica records the
tenant with the job (a re-run carries it on), and every ask says whose jobs the
caller sees, so each replica answers a caller about its own tenant's jobs only.
Another tenant's job is the 404 of an unknown id, from any router, after any restart.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Final, NoReturn

import msgspec

from dpserve.contract import protocol as p
from dpserve.contract import validation as pv
from dpserve.contract import video
from dpserve.contract.owners import may_see
from dpserve.router.connection import ReplicaLost
from dpserve.router.job_records import JobRecord
from dpserve.router.leases import Leases
from dpserve.router.pool import ReplicaPool
from dpserve.router.replica import Replica, Slot
from dpserve.router.usage import Work
from dpserve.sources.outstore import StoreDown, VideoObjects

log = logging.getLogger(__name__)

# Submit carries an input image, content the mp4 (up to a reply frame): more than a
# ping's time. Every other action is a record and is answered in a ping's time.
TRANSFER_TIMEOUT_S: Final = 60.0


@dataclass(frozen=True)
class Held:
    """A job's record and the replica that holds it (None: this router's last view of
    a job it watches, whose holder does not answer now or which waits to run again)."""

    job: video.VideoJob
    replica: Replica | None
    recorded: bool = False  # the store's record: no replica holds the job


@dataclass
class Watch:
    """A job this router placed or took over, and where it runs now (dpserve/router/videos.py
    watches it; its last view answers while no replica does)."""

    job_id: str
    params: p.GenerateParams
    created_at: int
    blobs: list[bytes]
    slot: Slot | None  # None: its holder was lost, and no replica has taken it again yet
    boot: str  # the holder's boot id when it took the job
    last: video.VideoJob  # its record as last seen
    tenant: str  # who owns it: recorded with every copy, re-runs included
    attempt: int = 1
    misses: int = 0  # gets in a row that timed out
    lost_at: float | None = None  # monotonic; when its holder was lost
    lost: tuple[Replica | None, str] | None = None  # that holder (None: unknown here), its boot
    may_return: bool = False  # the lost holder was unreachable: it may still hold the job
    lost_endpoint: str = ""  # that holder's endpoint (a taken-over job's may be unknown here)
    stale: list[tuple[Replica, str]] = field(default_factory=list)  # copies left behind
    task: asyncio.Task[None] | None = None
    meter: Callable[[Work], None] | None = None  # counts its frames once it completes

    def view(self) -> video.VideoJob:
        """The job as this router last saw it; queued again while it waits for a replica."""
        if self.slot is None:
            return msgspec.structs.replace(self.last, status=video.QUEUED, progress=0)
        return self.last


class JobLookup:
    """Find, content, list and delete over the state of :class:`VideoJobs` (its
    subclass), which owns it: the pool, the store and its leases, and the watches."""

    pool: ReplicaPool
    objects: VideoObjects | None
    leases: Leases | None
    _watches: dict[str, Watch]

    async def find(self, job_id: str, scope: str | None = None) -> Held:
        """The job's newest copy, wherever it is; 404 when no replica holds it, or when
        it is not ``scope``'s (dpserve/contract/owners.py: the same 404, word for word).

        A job this router watches is never a 404 while its holder is being replaced:
        its last view answers (queued again while it waits for a replica). Where the
        owner did not answer at all, the job's fate is unknown: 503, retry."""
        owner = _owner(job_id)
        asked: set[str] = set()
        silent: list[str] = []
        ask = get_request(job_id, scope)
        for replica in self._first_asks(job_id, owner):
            asked.add(replica.endpoint)
            held = await self._held(replica, ask, silent)
            if held is not None:
                return held
        others = [r for r in self.pool.members() if r.answering and r.endpoint not in asked]
        found = await asyncio.gather(*(self._held(r, ask, silent) for r in others))
        held = _newest(list(found))
        if held is not None:
            return held
        watch = self._watches.get(job_id)
        if watch is not None and may_see(scope, watch.tenant):
            return Held(watch.view(), None)
        record = await self._recorded(job_id)
        if record is not None and may_see(scope, record.job.tenant) and not _expired(record.job):
            return Held(record.job, None, recorded=True)
        if silent:
            raise p.RequestError(
                p.UNAVAILABLE,
                f"video {job_id} could not be looked up: {', '.join(silent)} did not answer; "
                "retry shortly",
            )
        self._missing(job_id, owner)

    async def content(
        self, job_id: str, variant: str, scope: str | None = None
    ) -> tuple[video.VideoContent, bytes]:
        """A completed job's mp4 or thumbnail; 409 while it is not completed."""
        if variant not in video.MEDIA_TYPES:
            offered = ", ".join(video.MEDIA_TYPES)
            raise pv.invalid_fields(
                [p.FieldError("variant", f"is {variant[:40]!r}; this service offers {offered}")]
            )
        store_down: StoreDown | None = None
        try:
            stored = await self._stored(job_id, variant, scope)
        except StoreDown as exc:  # the owner may still say the job is not done
            stored, store_down = None, exc
        if stored is not None:
            return video.VideoContent(
                id=job_id, variant=variant, media_type=video.MEDIA_TYPES[variant]
            ), stored
        try:
            held = await self.find(job_id, scope)
        except p.RequestError:
            if store_down is None:
                raise
            raise p.RequestError(p.UNAVAILABLE, f"video {job_id}: {store_down}; retry") from None
        job, replica = held.job, held.replica
        if job.status != video.COMPLETED:
            why = f": {job.error.message}" if job.error is not None else ""
            done = job.status in video.TERMINAL
            raise p.RequestError(
                p.CONFLICT,
                f"video {job_id} is {job.status} ({job.progress}%){why}: "
                + ("it has no content" if done else "its content is not ready"),
            )
        if held.recorded:  # the store's record says completed; its objects are not there
            raise p.RequestError(
                p.NOT_FOUND, f"video {job_id}'s content is gone from the store (deleted or expired)"
            )
        if replica is None:
            raise p.RequestError(
                p.UNAVAILABLE, f"the replica holding video {job_id} does not answer; retry"
            )
        request = video.VideoRequest(
            action=video.CONTENT, job_id=job_id, variant=variant, scope=scope
        )
        try:
            reply = await self._ask(replica, request, TRANSFER_TIMEOUT_S)
            meta: video.VideoContent = reply.body_as(video.VideoContent)
            return meta, reply.blobs[0]
        except (ReplicaLost, TimeoutError) as exc:
            raise p.RequestError(
                p.UNAVAILABLE, f"{replica.name} holding video {job_id} did not answer: {exc}"
            ) from None
        except (p.ProtocolError, IndexError) as exc:
            raise p.RequestError(
                p.INTERNAL, f"unreadable content from {replica.name}: {exc}"
            ) from None

    async def _stored(self, job_id: str, variant: str, scope: str | None) -> bytes | None:
        """The store's copy, when there is a store and it holds one ``scope`` sees;
        proxied, not redirected to (docs/outputs.md says why)."""
        if self.objects is None:
            return None
        return await asyncio.to_thread(self.objects.read, job_id, variant, scope)

    async def all_jobs(self, scope: str | None = None) -> list[video.VideoJob]:
        """Every job of ``scope`` the answering replicas hold, one record per id (its
        newest copy)."""
        replicas = [r for r in self.pool.members() if r.answering]
        lists = await asyncio.gather(*(self._list(r, scope) for r in replicas))
        newest: dict[str, video.VideoJob] = {}
        for job in (j for jobs in lists for j in jobs):
            if job.id not in newest or job.attempt > newest[job.id].attempt:
                newest[job.id] = job
        for job_id, watch in self._watches.items():  # its holder silent, or none yet
            if job_id not in newest and may_see(scope, watch.tenant):
                newest[job_id] = watch.view()
        for record in await self._active_records():  # unfinished, no replica holds it
            if record.job.id not in newest and may_see(scope, record.job.tenant):
                newest[record.job.id] = record.job
        return list(newest.values())

    async def _active_records(self) -> list[JobRecord]:
        if self.leases is None:
            return []
        try:
            return await self.leases.active_records()
        except StoreDown as exc:
            log.warning("video list: the store's unfinished jobs are left out: %s", exc)
            return []

    async def delete(self, job_id: str, scope: str | None = None) -> video.VideoJob:
        """Delete every copy (a running one stops at its next step); its newest record.
        Another tenant's job (not ``scope``'s) is a 404, untouched: each replica checks.

        Its watch ends now (nothing runs it again), but its slot is released only once
        the replicas have answered: until its replica has deleted it, the job is
        there, queued or running, and its work counts there."""
        owner = _owner(job_id)
        watch = self._watches.get(job_id)
        if watch is not None and may_see(scope, watch.tenant):
            del self._watches[job_id]
        else:
            watch = None
        slot = None
        if watch is not None:
            slot, watch.slot = watch.slot, None
            if watch.task is not None:
                watch.task.cancel()
        replicas = [r for r in self.pool.members() if r.answering]
        try:
            ask = delete_request(job_id, scope)
            found = await asyncio.gather(*(self._held(r, ask) for r in replicas))
        finally:
            if slot is not None:
                self.pool.admission.release(slot)
        held = _newest(list(found))
        stored = await self._delete_stored(job_id, scope)
        if held is not None:
            return held.job
        if stored is not None:  # its owner is gone; the store held the job
            return stored
        if watch is not None:  # waiting to run again: stopping its watch deleted it
            return msgspec.structs.replace(watch.last, status=video.CANCELLED)
        self._missing(job_id, owner)

    async def _delete_stored(self, job_id: str, scope: str | None) -> video.VideoJob | None:
        """Remove the job from the store (its record, every attempt's objects), if
        ``scope`` sees it; its record then (None: the store held none of it). The owner
        removes its objects too: this covers an owner that is gone."""
        if self.objects is None:
            return None
        objects, leases = self.objects, self.leases
        try:
            if leases is not None:
                record = await leases.lookup(job_id)
                if record is not None:
                    if not may_see(scope, record.job.tenant):
                        return None
                    await leases.remove(job_id)
                    return msgspec.structs.replace(record.job, status=video.CANCELLED)
            if not await asyncio.to_thread(objects.holds, job_id, scope):
                return None
            await asyncio.to_thread(objects.delete, job_id)
            return _deleted_record(job_id)
        except StoreDown as exc:
            raise p.RequestError(p.UNAVAILABLE, f"video {job_id}: {exc}; retry") from None

    async def _recorded(self, job_id: str) -> JobRecord | None:
        """The store's record of the job (None: no record, or no store)."""
        if self.leases is None:
            return None
        try:
            return await self.leases.lookup(job_id)
        except StoreDown as exc:
            raise p.RequestError(
                p.UNAVAILABLE, f"video {job_id} could not be looked up: {exc}; retry shortly"
            ) from None

    # ------------------------------------------------------------ plumbing

    def _first_asks(self, job_id: str, owner: video.JobOwner) -> list[Replica]:
        """Where the job most likely is: where this router watches it, then its owner."""
        first: list[Replica] = []
        watch = self._watches.get(job_id)
        if watch is not None and watch.slot is not None and watch.slot.replica.answering:
            first.append(watch.slot.replica)
        replica = self.pool.replicas.get(owner.endpoint)
        if replica is not None and replica.answering and replica not in first:
            first.append(replica)
        return first

    def _missing(self, job_id: str, owner: video.JobOwner) -> NoReturn:
        replica = self.pool.replicas.get(owner.endpoint)
        if replica is None or not replica.answering or replica.boot_id[:8] != owner.boot:
            raise p.RequestError(
                p.NOT_FOUND,
                f"video {job_id} was lost with the replica that ran it ({owner.endpoint} has "
                "left, stopped answering or restarted) and no replica holds a re-run (the "
                "router that placed it starts one within seconds if it is up); else submit "
                "it again",
            )
        raise p.RequestError(
            p.NOT_FOUND,
            f"no video {job_id}: unknown, deleted or expired (finished videos are kept "
            "for a while only)",
        )

    async def _held(
        self, replica: Replica, request: video.VideoRequest, silent: list[str] | None = None
    ) -> Held | None:
        """The replica's answer; None when it has no such job, or did not answer (then
        its name goes in ``silent``)."""
        try:
            return Held(job_of(await self._ask(replica, request), replica), replica)
        except (ReplicaLost, TimeoutError, p.RequestError) as exc:
            if not (isinstance(exc, p.RequestError) and exc.code == p.NOT_FOUND):
                what = f"video {request.action} of {request.job_id}"
                log.info("%s: %s did not answer: %s", what, replica.name, exc)
                if silent is not None and not isinstance(exc, p.RequestError):
                    silent.append(replica.name)
            return None

    async def _list(self, replica: Replica, scope: str | None) -> list[video.VideoJob]:
        try:
            reply = await self._ask(replica, video.VideoRequest(action=video.LIST, scope=scope))
            listed: video.VideoList = reply.body_as(video.VideoList)
        except (ReplicaLost, TimeoutError, p.RequestError, p.ProtocolError) as exc:
            log.warning("video list: %s did not answer: %s", replica.name, exc)
            return []
        return listed.jobs

    async def _ask(
        self,
        replica: Replica,
        request: video.VideoRequest,
        timeout_s: float | None = None,
        blobs: list[bytes] | None = None,
    ) -> p.Message:
        timeout_s = self.pool.settings.ping_timeout_s if timeout_s is None else timeout_s
        return await self.pool.membership.request(replica, p.VIDEO, request, timeout_s, blobs)


def _owner(job_id: str) -> video.JobOwner:
    owner = video.job_owner(job_id)
    if owner is None:
        raise p.RequestError(
            p.NOT_FOUND, f"{job_id[:80]!r} is not a video id this service gave out"
        )
    return owner


def get_request(job_id: str, scope: str | None = None) -> video.VideoRequest:
    return video.VideoRequest(action=video.GET, job_id=job_id, scope=scope)


def delete_request(job_id: str, scope: str | None = None) -> video.VideoRequest:
    return video.VideoRequest(action=video.DELETE, job_id=job_id, scope=scope)


def job_of(reply: p.Message, replica: Replica) -> video.VideoJob:
    try:
        job: video.VideoJob = reply.body_as(video.VideoJob)
    except p.ProtocolError as exc:
        raise p.RequestError(p.INTERNAL, f"unreadable job from {replica.name}: {exc}") from None
    return job


def _deleted_record(job_id: str) -> video.VideoJob:
    """What a delete answers for a job known only by its objects (its record is gone
    with its owner): the id is all the answer says."""
    return video.VideoJob(
        id=job_id,
        status=video.COMPLETED,
        created_at=0,
        width=0,
        height=0,
        num_frames=0,
        fps=0,
        seconds=0.0,
        seed=0,
    )


def _expired(job: video.VideoJob) -> bool:
    return job.expires_at is not None and job.expires_at <= time.time()


def _newest(found: list[Held | None]) -> Held | None:
    held = [h for h in found if h is not None]
    return max(held, key=lambda h: h.job.attempt) if held else None
