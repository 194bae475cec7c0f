"""One router's side of the job records (dpserve/router/job_records.py): the leases it
holds, renewed while it watches their jobs, and the ones it takes over from routers
that are gone. Store calls run on threads; the event loop never waits on the store
for anything but these calls' own awaits.

**Lease.** A router holds a job's lease while it watches the job and until its
terminal event is delivered; each write renews it for ``lease_s``. A router that
dies stops renewing: once ``lease_s`` has passed, any router may take the lease
(a conditional write: one wins) and watch the job from its record. A router that
finds its write refused has lost the lease (it stalled past ``lease_s`` and another
took over, or the job was deleted): it stops watching, and tells nothing.

Clocks: a lease is unix time, so routers' clocks must agree to well within
``lease_s`` (NTP does; a pod's clock is its node's).
"""

from __future__ import annotations

import asyncio
import logging
import os
import secrets
import socket
import time
from typing import Final

import msgspec

from dpserve.contract import protocol as p
from dpserve.contract import video
from dpserve.router.job_records import JobRecord, JobRecords, Stored
from dpserve.sources.outstore import StoreDown

log = logging.getLogger(__name__)

MIN_LEASE_S: Final = 3.0
LEASE_POLLS: Final = 10  # a lease lasts this many polls (at least MIN_LEASE_S)


def lease_seconds(poll_s: float) -> float:
    """How long a lease lasts: long enough that a store hiccup of a few polls does not
    hand a live router's job to another; short enough that a dead router's jobs are
    taken over in seconds."""
    return max(MIN_LEASE_S, LEASE_POLLS * poll_s)


def router_id() -> str:
    """This router process, as leases name it (a pod's hostname is its name)."""
    return f"{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(3)}"


class Leases:
    """The leases of one router; every method raises ``StoreDown`` when the store does
    not answer."""

    def __init__(self, records: JobRecords, lease_s: float, me: str | None = None) -> None:
        self.records = records
        self.lease_s = lease_s
        self.me = me or router_id()
        self._held: dict[str, Stored] = {}

    def holds(self, job_id: str) -> bool:
        return job_id in self._held

    async def open(
        self,
        job: video.VideoJob,
        params: p.GenerateParams,
        blobs: list[bytes],
        holder: str,
        boot: str,
    ) -> None:
        """A job this router just placed: its record, leased to this router."""
        record = JobRecord(
            job=job,
            params=params,
            holder=holder,
            boot=boot,
            router=self.me,
            lease_until=time.time() + self.lease_s,
        )
        self._held[job.id] = await asyncio.to_thread(self.records.create, record, blobs)

    async def note(
        self,
        job: video.VideoJob,
        holder: str | None = None,
        boot: str | None = None,
        announced: bool = False,
    ) -> bool:
        """Record the job's status (and holder, when it moved), renewing the lease when
        anything changed or a third of it is spent; False when the lease is lost."""
        held = self._held.get(job.id)
        if held is None:
            return False
        old = held.record
        record = msgspec.structs.replace(
            old,
            job=job,
            holder=old.holder if holder is None else holder,
            boot=old.boot if boot is None else boot,
            announced=announced,
        )
        fresh = old.lease_until - time.time() > self.lease_s * 2 / 3
        if fresh and _same(old, record):
            return True
        return await self._write(held, record)

    async def renew(self, job_id: str) -> bool:
        """Keep the lease of a job whose status does not change (its event in flight)."""
        held = self._held.get(job_id)
        if held is None:
            return False
        return await self._write(held, held.record)

    async def settle(self, job_id: str) -> None:
        """The job is finished and told: its lease ends, it leaves the active index."""
        held = self._held.pop(job_id, None)
        if held is not None:
            await asyncio.to_thread(self.records.settle, held.record)

    def release(self, job_id: str) -> None:
        """Stop holding a lease without writing (the job was deleted here)."""
        self._held.pop(job_id, None)

    async def orphans(self) -> list[Stored]:
        """Records of active jobs whose lease ran out (their router is gone)."""
        now = time.time()
        orphans = []
        for job_id, stored in await self._active(skip_held=True):
            if stored is None:  # deleted: its index entry is left over
                await asyncio.to_thread(self.records.unindex, job_id)
            elif stored.record.lease_until < now:
                orphans.append(stored)
        return orphans

    async def active_records(self) -> list[JobRecord]:
        """Records of every job that still needs a watcher."""
        return [stored.record for _, stored in await self._active() if stored is not None]

    async def _active(self, skip_held: bool = False) -> list[tuple[str, Stored | None]]:
        ids = await asyncio.to_thread(self.records.active)
        if skip_held:
            ids = [i for i in ids if i not in self._held]
        found = await asyncio.gather(*(asyncio.to_thread(self.records.read, i) for i in ids))
        return list(zip(ids, found, strict=True))

    async def take(self, stored: Stored) -> JobRecord | None:
        """Take an orphan's lease; its record when this router won it."""
        if not await self._write(stored, stored.record):
            return None
        log.warning(
            "video job %s: taken over from router %s, whose lease ran out",
            stored.record.job.id,
            stored.record.router or "?",
        )
        return self._held[stored.record.job.id].record

    async def lookup(self, job_id: str) -> JobRecord | None:
        held = self._held.get(job_id)
        if held is not None:
            return held.record
        stored = await asyncio.to_thread(self.records.read, job_id)
        return None if stored is None else stored.record

    async def inputs(self, record: JobRecord) -> list[bytes]:
        return await asyncio.to_thread(self.records.inputs, record)

    async def remove(self, job_id: str) -> JobRecord | None:
        """Delete the job from the store; its record, if there was one."""
        self._held.pop(job_id, None)
        stored = await asyncio.to_thread(self.records.read, job_id)
        expires = None if stored is None else stored.record.job.expires_at
        await asyncio.to_thread(self.records.remove, job_id, expires)
        return None if stored is None else stored.record

    async def expire(self) -> int:
        """Remove the jobs whose expiry has come; how many."""
        due = await asyncio.to_thread(self.records.expired, time.time())
        for job_id in due:
            await asyncio.to_thread(self.records.remove, job_id, None)
        return len(due)

    async def _write(self, held: Stored, record: JobRecord) -> bool:
        record = msgspec.structs.replace(
            record, router=self.me, lease_until=time.time() + self.lease_s
        )
        written = await asyncio.to_thread(self.records.replace, held, record)
        job_id = record.job.id
        if written is None:
            if self._held.pop(job_id, None) is not None:
                log.warning("video job %s: its lease was taken over (or it was deleted)", job_id)
            return False
        self._held[job_id] = written
        return True


def _same(old: JobRecord, new: JobRecord) -> bool:
    """Nothing worth a write changed (progress alone is not)."""
    a, b = old.job, new.job
    return (a.status, a.attempt, a.replica) == (b.status, b.attempt, b.replica) and (
        old.holder,
        old.boot,
        old.announced,
    ) == (new.holder, new.boot, new.announced)


__all__ = ["Leases", "StoreDown", "lease_seconds"]
