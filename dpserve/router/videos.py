"""Video jobs through the router: placement, the watch that re-runs a lost job, and
finding any job from any router (dpserve/contract/video.py has the whole design).

**Place.** A job takes a slot at once (:meth:`Admission.place`: the policy's pick,
past the in-flight cap, no waiting): it queues at its replica, whose --max-queue
bounds it, and its slot keeps its estimated work in that replica's ledger, so image
requests see the replica busy and the autoscaling gauges count it. Its id names the
replica and that replica's boot (:func:`video.make_job_id`). A replica that refuses
for itself (overloaded, shutting down, unreachable) passes the job on, with a new
id, to the next one; each serving replica is asked at most once.

**Bound.** A job is estimated on the replica that takes it (its cost units times the
measured seconds per unit, :meth:`Load.measured_seconds`); one estimated past
``max_run_s`` is a 400 naming both. The bound also travels with the job: its replica
stops it once it has run that long, which bounds a job no replica could estimate yet
(none has measured) and one the estimate got wrong.

**Watch.** This router follows every job it placed, one task each, polling its
holder every ``poll_s``; a terminal status, or the job gone from a holder that did
not restart (deleted, expired), ends the watch and frees the slot. A holder that is
lost (its connection dropped, it stopped answering, it left the pool, or it
restarted: its boot id changed) lost the job with it, as did one that failed it
because it was shutting down (``unavailable``): the job is submitted again
elsewhere under the same id, with the same parameters and seed, creation time and
``attempt`` + 1, so it makes the same frames. At most ``MAX_ATTEMPTS``; while no
replica takes it, each poll tries again, for the request timeout. A lost holder
that comes back with its boot unchanged (it was only unreachable) had kept the job:
before the re-run it is simply watched again; after it, or when it had given the
job up, its copy is deleted once it answers, so no router finds a stale one there.

**Find.** Nothing about a job lives in a router, so any router finds any job: it
asks the replica it watches the job on, then the owner the id names, and then every
answering replica at once (a re-run lives elsewhere under the same id); the copy
with the highest ``attempt`` wins. List, and delete, ask every answering replica.

**Own.** A job belongs to the tenant that submitted it: the replica records the
tenant with the job (a re-run carries it on), and every ask says whose jobs the
caller sees, so each replica answers a caller about its own tenant's jobs only.
Another tenant's job is the 404 of an unknown id, from any router, after any restart.

**Tell.** The watch hands the record it ends on (completed or failed; a given-up
job as failed) to ``on_finish``: the webhooks' queue (dpserve/router/webhooks.py),
which never makes it wait.

A job whose router goes away is not re-run if its holder is lost later (nobody
watches it); it runs to its end where it is, and any router finds it (and no
webhook event is sent for it).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any, Final, NoReturn

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

MAX_ATTEMPTS: Final = 3
EXPIRY_SWEEP_S: Final = 60.0  # between two looks for expired jobs in the store
HAND_OVER_S: Final = 5.0  # a stopping router's last writes: its leases end now
# Submit carries an input image, content the mp4 (up to a reply frame): more than a
# ping's time. Every other action is a record and is answered in a ping's time.
TRANSFER_TIMEOUT_S: Final = 60.0
# Refusals that say "this replica, not this job": the next one may take it.
_PASS_ON: Final = frozenset({p.OVERLOADED, p.UNAVAILABLE})


@dataclass(frozen=True)
class Held:
    """A job's record and the replica that holds it (None: this router's last view of
    a job it watches, whose holder does not answer now or which waits to run again)."""

    job: video.VideoJob
    replica: Replica | None
    recorded: bool = False  # the store's record: no replica holds the job


@dataclass
class _Watch:
    """A job this router placed, and where it runs now."""

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


class VideoJobs:
    """Every video job action of one router; :meth:`close` ends its watches."""

    def __init__(
        self,
        pool: ReplicaPool,
        poll_s: float,
        max_run_s: float,
        on_finish: Callable[[video.VideoJob, Callable[[], None]], None] | None = None,
        objects: VideoObjects | None = None,
        leases: Leases | None = None,
        video_ttl_s: float = 3600.0,
    ) -> None:
        """``poll_s``: between looks at each job; ``max_run_s``: the longest a job may
        run, in seconds (the router's --video-poll and --video-max-estimate);
        ``on_finish``: told each job's terminal record once its watch sees it, or a
        failed one when it is given up, and a callback to call once it is delivered
        or given up (the webhooks' emit: it must not wait); ``objects``: the output
        store the replicas upload finished videos to, read for content before any
        replica is asked (docs/outputs.md, "Videos"); ``leases``: the job records
        in that store, which let any router answer for and take over a job whose
        router is gone (None: jobs live on their replicas only); ``video_ttl_s``:
        how long a job found finished in the store alone is kept (its replica's
        --video-ttl, which it did not live to apply)."""
        self.pool = pool
        self.objects = objects
        self._on_finish = on_finish
        self.poll_s = poll_s
        self.max_run_s = max_run_s
        self.leases = leases
        self.video_ttl_s = video_ttl_s
        self._watches: dict[str, _Watch] = {}
        self._submits: set[asyncio.Task[video.VideoJob]] = set()
        self._tasks: set[asyncio.Task[None]] = set()  # the sweep, and events in flight

    def start(self) -> None:
        """With job records: sweep for jobs whose router is gone, and for expired ones."""
        if self.leases is not None:
            self._spawn(self._sweep_forever(self.leases), "video job sweep")

    def _spawn(self, work: Coroutine[Any, Any, None], name: str) -> None:
        task = asyncio.create_task(work, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    @property
    def watched(self) -> int:
        """Jobs this router watches (placed here, not yet finished)."""
        return len(self._watches)

    async def close(self) -> None:
        tasks = [
            *self._submits,
            *self._tasks,
            *(w.task for w in self._watches.values() if w.task),
        ]
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        if self.leases is not None:  # a crash skips this: its leases run out instead
            try:
                handed = await asyncio.wait_for(self.leases.hand_over(), HAND_OVER_S)
            except TimeoutError:
                log.warning("video jobs: the store did not take the hand-over in time")
            else:
                if handed:
                    log.info("video jobs: %d handed over to the other routers", handed)

    # ------------------------------------------------------------ submit

    async def submit(
        self,
        params: p.GenerateParams,
        blobs: list[bytes],
        tenant: str = "",
        meter: Callable[[Work], None] | None = None,
    ) -> video.VideoJob:
        """Place a new job of ``tenant`` and start watching it; its record as its replica
        took it (the replica records the tenant with it). ``meter`` counts what it made
        once this router sees it completed.

        The submission finishes even if its caller is cancelled (a client that left):
        a job a replica took is then watched like any other, not orphaned there.
        """
        task = asyncio.ensure_future(self._submit(pv.fill_seeds(params), blobs, tenant, meter))
        self._submits.add(task)
        task.add_done_callback(self._submits.discard)
        task.add_done_callback(lambda done: done.cancelled() or done.exception())
        return await asyncio.shield(task)

    async def _submit(
        self,
        params: p.GenerateParams,
        blobs: list[bytes],
        tenant: str,
        meter: Callable[[Work], None] | None,
    ) -> video.VideoJob:
        created_at = int(time.time())
        tried: set[str] = set()
        refusals: list[str] = []
        busy = False
        while True:
            try:
                slot = self.pool.admission.place(tried, params)
            except p.RequestError:
                if not tried:
                    raise
                break
            replica = slot.replica
            if replica.endpoint in tried:  # every serving replica was asked
                self.pool.admission.release(slot)
                break
            tried.add(replica.endpoint)
            try:
                self._check_bound(replica, params)
            except p.RequestError:
                self.pool.admission.release(slot)
                raise
            job_id = video.make_job_id(replica.endpoint, replica.boot_id)
            try:
                job = await self._send(slot, job_id, params, created_at, 1, blobs, tenant)
            except p.RequestError as exc:
                self.pool.admission.release(slot)
                if exc.code not in _PASS_ON:
                    raise
                busy = busy or exc.code == p.OVERLOADED
                refusals.append(f"{replica.name}: {exc}")
                continue
            except (ReplicaLost, TimeoutError) as exc:
                self.pool.admission.release(slot)
                refusals.append(f"{replica.name}: {str(exc) or 'timed out'}")
                continue
            watch = _Watch(job_id, params, created_at, blobs, slot, replica.boot_id, job, tenant)
            watch.meter = meter
            await self._record(watch, job)
            self._watch(watch)
            return job
        code = p.OVERLOADED if busy else p.UNAVAILABLE
        raise p.RequestError(code, f"no replica took the job ({'; '.join(refusals)}); retry later")

    async def _send(
        self,
        slot: Slot,
        job_id: str,
        params: p.GenerateParams,
        created_at: int,
        attempt: int,
        blobs: list[bytes],
        tenant: str,
    ) -> video.VideoJob:
        """Submit to the slot's replica. A replica that cannot take work now (shutting
        down, unreachable) leaves rotation until its pings say otherwise."""
        replica = slot.replica
        request = video.VideoRequest(
            action=video.SUBMIT,
            job_id=job_id,
            params=params,
            created_at=created_at,
            attempt=attempt,
            estimated_s=self.pool.load.measured_seconds(replica, params),
            max_run_s=self.max_run_s,
            tenant=tenant,
        )
        try:
            reply = await self._ask(replica, request, TRANSFER_TIMEOUT_S, blobs)
        except p.RequestError as exc:
            if exc.code == p.UNAVAILABLE:
                self.pool.health.mark_failed(replica, str(exc))
            raise
        except (ReplicaLost, TimeoutError) as exc:
            self.pool.health.mark_failed(replica, f"video submit failed: {str(exc) or 'timed out'}")
            raise
        return _job(reply, replica)

    async def _record(self, watch: _Watch, job: video.VideoJob) -> None:
        """Keep a new job's record in the store before its id is answered: a job the
        store does not hold would not outlive its router. With the store down the job
        is taken back from its replica and the client gets a 503."""
        if self.leases is None:
            return
        assert watch.slot is not None
        replica = watch.slot.replica
        try:
            await self.leases.open(job, watch.params, watch.blobs, replica.endpoint, watch.boot)
        except StoreDown as exc:
            self.pool.admission.release(watch.slot)
            with contextlib.suppress(ReplicaLost, TimeoutError, p.RequestError):
                await self._ask(replica, _delete(watch.job_id))
            raise p.RequestError(
                p.UNAVAILABLE, f"the video job was not kept ({exc}); retry"
            ) from None

    def _check_bound(self, replica: Replica, params: p.GenerateParams) -> None:
        """A 400 when the job's estimated run time there is past the bound."""
        estimate = self.pool.load.measured_seconds(replica, params)
        if estimate is None or estimate <= self.max_run_s:
            return
        raise p.RequestError(
            p.INVALID_REQUEST,
            f"this video job is estimated to run {estimate:.0f}s ({_shape(params, replica)}), "
            f"past this service's bound of {self.max_run_s:g}s on a job's run time "
            "(the router's --video-max-estimate; spec.router.videoMaxEstimateSeconds on "
            "Kubernetes): ask for a smaller size, fewer frames (seconds) or fewer "
            "num_inference_steps",
        )

    # ------------------------------------------------------------ watch

    def _watch(self, watch: _Watch) -> None:
        self._watches[watch.job_id] = watch
        watch.task = asyncio.create_task(self._follow(watch), name=f"video {watch.job_id}")

    async def _follow(self, watch: _Watch) -> None:
        try:
            while True:
                await asyncio.sleep(self.poll_s)
                try:
                    if await self._look(watch) or not await self._keep(watch.job_id):
                        return
                except Exception:  # one bad look must not end the watch
                    log.exception("watching video job %s failed", watch.job_id)
        finally:
            if watch.slot is not None:
                self.pool.admission.release(watch.slot)
                watch.slot = None
            if self._watches.get(watch.job_id) is watch:
                del self._watches[watch.job_id]

    async def _look(self, watch: _Watch) -> bool:
        """One poll of the job; True when the watch is over."""
        await self._delete_stale(watch)
        if watch.slot is None:
            return await self._rerun(watch)
        holder = watch.slot.replica
        if self._lost(holder, watch.boot):
            why = "it left the pool, stopped answering or restarted"
            return await self._lose(watch, why, may_return=holder.boot_id == watch.boot)
        try:
            job = _job(await self._ask(holder, _get(watch.job_id)), holder)
        except ReplicaLost as exc:
            return await self._lose(watch, str(exc), may_return=True)
        except TimeoutError:
            watch.misses += 1
            if watch.misses >= self.pool.settings.abandon_after_missed_pings:
                why = f"{watch.misses} polls timed out"
                return await self._lose(watch, why, may_return=True)
            return False
        except p.RequestError as exc:
            if exc.code != p.NOT_FOUND:
                log.warning("video job %s: %s answered %s", watch.job_id, holder.name, exc)
                return False
            boot = await self.pool.health.boot_id(holder)
            if boot != watch.boot:  # not_found from a restart its pings have not shown yet
                why = "it does not hold the job"
                return await self._lose(watch, why, may_return=boot is None)
            if await self._still_recorded(watch.job_id):  # not deleted: never got there
                return await self._lose(watch, "it does not hold the job", may_return=False)
            log.info("video job %s is gone from %s: %s", watch.job_id, holder.name, exc)
            return True
        watch.misses, watch.last = 0, job
        if _given_up(job):
            assert job.error is not None
            return await self._lose(watch, job.error.message, may_return=False)
        if job.status in video.TERMINAL:
            log.info("video job %s %s on %s", job.id, job.status, holder.name)
            if job.status == video.COMPLETED and watch.meter is not None:
                units = watch.slot.units
                watch.meter(Work(0, job.num_frames, units, job.inference_time_s, job.queue_time_s))
            await self._end(job)
            return True
        return not await self._note(job)  # lost its lease: another router watches it

    def _lost(self, holder: Replica, boot: str) -> bool:
        gone = not self.pool.membership.holds(holder)
        return gone or not holder.answering or holder.boot_id != boot

    async def _lose(self, watch: _Watch, why: str, may_return: bool) -> bool:
        """The holder lost the job, or gave it up, or cannot be reached (``may_return``:
        it may come back holding it): run it again."""
        assert watch.slot is not None
        holder = watch.slot.replica
        log.warning("video job %s: its replica %s was lost (%s)", watch.job_id, holder.name, why)
        self.pool.admission.release(watch.slot)
        watch.slot, watch.misses, watch.lost_at = None, 0, time.monotonic()
        watch.lost, watch.may_return = (holder, watch.boot), may_return
        watch.lost_endpoint = holder.endpoint
        if await self._uploaded(watch):
            return True
        return await self._rerun(watch)

    async def _uploaded(self, watch: _Watch) -> bool:
        """Whether the lost holder had uploaded the job's outputs (it died before its
        record said completed): then the job is completed as it is, not run again."""
        if self.objects is None:
            return False
        try:
            location = await asyncio.to_thread(self.objects.finished, watch.job_id, watch.attempt)
        except StoreDown as exc:
            log.warning("video job %s: the store did not say if it is done: %s", watch.job_id, exc)
            return False
        if location is None:
            return False
        now = int(time.time())
        job = msgspec.structs.replace(
            watch.last,
            status=video.COMPLETED,
            progress=100,
            completed_at=now,
            expires_at=now + int(self.video_ttl_s),
            location=location,
            error=None,
        )
        log.info("video job %s was uploaded by its lost replica: completed", watch.job_id)
        watch.last = job
        await self._end(job)
        return True

    async def _rerun(self, watch: _Watch) -> bool:
        """Place the job again; True when it is given up."""
        assert watch.lost is not None and watch.lost_at is not None
        replica, boot = watch.lost
        if watch.may_return and replica is not None and not self._lost(replica, boot):
            # back, holding it: watch it
            watch.slot, watch.boot = self.pool.admission.take(replica, watch.params), boot
            watch.lost = watch.lost_at = None
            return False
        waited = time.monotonic() - watch.lost_at
        if watch.attempt >= MAX_ATTEMPTS or waited > self.pool.settings.request_timeout_s:
            why = (
                f"its replica was lost after {watch.attempt} attempts, and {waited:.0f} s "
                "without a replica to run it again"
            )
            log.error("video job %s is given up: %s", watch.job_id, why)
            await self._give_up(watch, why)
            return True
        try:
            slot = self.pool.admission.place({watch.lost_endpoint}, watch.params)
        except p.RequestError:
            return False  # none serves now: next poll
        attempt = watch.attempt + 1
        # Claim the run in the record before it starts: of two routers that both think
        # they watch the job (one stalled past its lease), only the one whose claim
        # lands runs it; the other runs and deletes nothing.
        claim = msgspec.structs.replace(watch.last, attempt=attempt, status=video.QUEUED)
        if not await self._note(claim, slot.replica.endpoint, slot.replica.boot_id):
            self.pool.admission.release(slot)
            return True
        try:
            job = await self._send(
                slot,
                watch.job_id,
                watch.params,
                watch.created_at,
                attempt,
                watch.blobs,
                watch.tenant,
            )
        except p.RequestError as exc:
            self.pool.admission.release(slot)
            if exc.code in _PASS_ON:
                return False
            name = slot.replica.name
            log.error("video job %s is given up: %s refused it: %s", watch.job_id, name, exc)
            await self._give_up(watch, f"{name} refused to run it again: {exc}")
            return True
        except (ReplicaLost, TimeoutError):
            self.pool.admission.release(slot)
            return False
        name = slot.replica.name
        log.warning("video job %s runs again on %s (attempt %d)", watch.job_id, name, attempt)
        if replica is not None and (slot.replica is not replica or slot.replica.boot_id != boot):
            watch.stale.append((replica, boot))  # its copy, if it has one, goes when it answers
        watch.slot, watch.boot, watch.attempt = slot, slot.replica.boot_id, attempt
        watch.lost, watch.lost_at, watch.last = None, None, job
        if not await self._note(job, slot.replica.endpoint, slot.replica.boot_id):
            # Another router took the job over meanwhile: this copy is not its own.
            with contextlib.suppress(ReplicaLost, TimeoutError, p.RequestError):
                await self._ask(slot.replica, _delete(watch.job_id))
            return True
        return False

    async def _give_up(self, watch: _Watch, why: str) -> None:
        """No replica holds the job any more, and none will: it failed."""
        error = video.VideoError(code=p.UNAVAILABLE, message=f"the job was given up: {why}")
        now = int(time.time())
        watch.last = msgspec.structs.replace(
            watch.last, status=video.FAILED, completed_at=now, error=error
        )
        await self._end(watch.last)

    # ------------------------------------------------------------ records and events

    async def _note(
        self,
        job: video.VideoJob,
        holder: str | None = None,
        boot: str | None = None,
        announced: bool = False,
    ) -> bool:
        """Record the job's status in the store; False when this router lost its lease
        (another router watches the job now, or it was deleted). A store that does
        not answer is logged: the lease may run out, and the router that takes it
        over is then the one whose writes land."""
        if self.leases is None:
            return True
        try:
            return await self.leases.note(job, holder, boot, announced)
        except StoreDown as exc:
            log.warning("video job %s: its record is not updated: %s", job.id, exc)
            return True

    async def _keep(self, job_id: str) -> bool:
        """Renew the lease of a job being watched when a third of it is spent, whatever
        the look did (a job waiting for a replica changes nothing for a while); False
        when it is lost."""
        if self.leases is None:
            return True
        try:
            return await self.leases.keep(job_id)
        except StoreDown as exc:
            log.warning("video job %s: its lease is not renewed: %s", job_id, exc)
            return True

    async def _still_recorded(self, job_id: str) -> bool:
        """Whether the store still has the job (a delete removes it)."""
        if self.leases is None:
            return False
        try:
            return await self.leases.lookup(job_id) is not None
        except StoreDown:
            return False

    async def _end(self, job: video.VideoJob) -> None:
        """A job reached its end: recorded, then told once. Only the router holding
        its lease tells; one that lost it leaves that to the router that took it."""
        if self.leases is None:
            self._tell(job, lambda: None)
            return
        if job.expires_at is None:  # a failed job's record expires too
            ended = job.completed_at or int(time.time())
            job = msgspec.structs.replace(job, expires_at=ended + int(self.video_ttl_s))
        silent = self._on_finish is None
        if not await self._note(job, announced=silent):
            return
        if silent:
            await self._settle(self.leases, job.id)
        else:
            self._spawn(self._announce(self.leases, job), f"video {job.id} event")

    def _tell(self, job: video.VideoJob, done: Callable[[], None]) -> None:
        if self._on_finish is None:
            done()
        else:
            self._on_finish(job, done)

    async def _announce(self, leases: Leases, job: video.VideoJob) -> None:
        """Tell a job's end, holding its lease until the event is delivered or given
        up: a router that dies first leaves the event to the one that takes the lease
        over (the same event id: receivers drop the repeat)."""
        told = asyncio.Event()
        self._tell(job, told.set)
        while not told.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(told.wait(), leases.lease_s / 3)
            if not told.is_set() and not await self._renew(leases, job.id):
                return
        if await self._note(job, announced=True):
            await self._settle(leases, job.id)

    async def _renew(self, leases: Leases, job_id: str) -> bool:
        try:
            return await leases.renew(job_id)
        except StoreDown as exc:
            log.warning("video job %s: its lease is not renewed: %s", job_id, exc)
            return True

    async def _settle(self, leases: Leases, job_id: str) -> None:
        try:
            await leases.settle(job_id)
        except StoreDown as exc:  # a sweep finds it active, told: it settles it then
            log.warning("video job %s: not settled in the store: %s", job_id, exc)

    # ------------------------------------------------------------ take over

    async def _sweep_forever(self, leases: Leases) -> None:
        """Take over the jobs of routers that are gone; remove expired jobs. The first
        sweep waits a whole lease: by then this router's pool has found and pinged its
        replicas, so a holder still running a job is not taken for lost."""
        last_expiry = 0.0
        await asyncio.sleep(leases.lease_s / 2)
        while True:
            await asyncio.sleep(leases.lease_s / 2)
            try:
                for stored in await leases.orphans():
                    if stored.record.job.id not in self._watches:
                        await self._adopt(leases, stored.record.job.id, await leases.take(stored))
                if time.monotonic() - last_expiry > EXPIRY_SWEEP_S:
                    last_expiry = time.monotonic()
                    if removed := await leases.expire():
                        log.info("%d expired video jobs were removed from the store", removed)
            except StoreDown as exc:
                log.warning("the video job sweep did not run: %s", exc)
            except Exception:  # one bad sweep must not end them
                log.exception("the video job sweep failed")

    async def _adopt(self, leases: Leases, job_id: str, record: JobRecord | None) -> None:
        """Watch a job taken over (``record``: None when another router took it)."""
        if record is None:
            return
        job = record.job
        if job.status in video.TERMINAL:  # finished; its event was not told
            if record.announced:
                await self._settle(leases, job_id)
            else:
                await self._end(job)
            return
        replica = self.pool.replicas.get(record.holder)
        if replica is not None and not replica.boot_id:  # not heard from yet: next sweep
            leases.release(job_id)
            return
        try:
            blobs = await leases.inputs(record)
        except StoreDown:
            leases.release(job_id)  # not watched here: its lease runs out, to be taken again
            raise
        watch = _Watch(
            job_id, record.params, job.created_at, blobs, None, record.boot, job, job.tenant
        )
        watch.attempt = job.attempt
        if replica is not None and not self._lost(replica, record.boot):
            watch.slot = self.pool.admission.take(replica, record.params)
        else:
            watch.lost, watch.lost_at = (replica, record.boot), time.monotonic()
            watch.lost_endpoint = record.holder
            if await self._uploaded(watch):
                return
        self._watch(watch)

    async def _delete_stale(self, watch: _Watch) -> None:
        """A holder that came back after the job ran again elsewhere drops its copy."""
        for replica, boot in list(watch.stale):
            if not self.pool.membership.holds(replica) or replica.boot_id != boot:
                watch.stale.remove((replica, boot))  # restarted or gone: no copy left
            elif replica.answering:
                with contextlib.suppress(ReplicaLost, TimeoutError, p.RequestError):
                    await self._ask(replica, _delete(watch.job_id))
                    log.info("video job %s: the copy on %s is deleted", watch.job_id, replica.name)
                watch.stale.remove((replica, boot))

    # ------------------------------------------------------------ find, list, delete

    async def find(self, job_id: str, scope: str | None = None) -> Held:
        """The job's newest copy, wherever it is; 404 when no replica holds it, or when
        it is not ``scope``'s (dpserve/contract/owners.py: the same 404, word for word).

        A job this router watches is never a 404 while its holder is being replaced:
        its last view answers (queued again while it waits for a replica). Where the
        owner did not answer at all, the job's fate is unknown: 503, retry."""
        owner = _owner(job_id)
        asked: set[str] = set()
        silent: list[str] = []
        ask = _get(job_id, scope)
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
            ask = _delete(job_id, scope)
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
            return Held(_job(await self._ask(replica, request), replica), replica)
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


def _shape(params: p.GenerateParams, replica: Replica) -> str:
    """What the estimate was of, with the replica's defaults for what the job left out."""
    cost = replica.cost
    width, height = params.width or cost.default_width, params.height or cost.default_height
    frames = (params.video.num_frames if params.video else None) or cost.default_frames
    steps = params.num_inference_steps or cost.default_steps
    return f"{width}x{height}, {frames} frames, {steps} steps"


def _get(job_id: str, scope: str | None = None) -> video.VideoRequest:
    return video.VideoRequest(action=video.GET, job_id=job_id, scope=scope)


def _delete(job_id: str, scope: str | None = None) -> video.VideoRequest:
    return video.VideoRequest(action=video.DELETE, job_id=job_id, scope=scope)


def _job(reply: p.Message, replica: Replica) -> video.VideoJob:
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


def _given_up(job: video.VideoJob) -> bool:
    """Failed because its replica shut down before running it: not the job's fault."""
    return job.status == video.FAILED and job.error is not None and job.error.code in _PASS_ON


def _newest(found: list[Held | None]) -> Held | None:
    held = [h for h in found if h is not None]
    return max(held, key=lambda h: h.job.attempt) if held else None
