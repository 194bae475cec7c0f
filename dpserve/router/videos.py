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

**Find, list, delete** are dpserve/router/video_lookup.py's: any router finds any
job, its tenant's only, from the replicas, this router's watches, then the store.

**Tell.** The watch hands the record it ends on (completed or failed; a given-up
job as failed) to ``on_finish``: the webhooks' queue (dpserve/router/webhooks.py),
which never makes it wait.

**Keep.** With a bucket output store each job is also a record there, leased to the
router that watches it (dpserve/router/leases.py): a router that goes away stops
renewing its leases (one that stops hands them over), and any router of the service
takes its jobs over and watches them from their records, re-running one whose
holder is gone too and telling each one's end. Without a store, a job whose router
goes away is not re-run if its holder is lost later (nobody watches it): it runs to
its end where it is, any router finds it, and no webhook event is sent for it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Coroutine
from typing import Any, Final

import msgspec

from dpserve.contract import protocol as p
from dpserve.contract import validation as pv
from dpserve.contract import video
from dpserve.router.connection import ReplicaLost
from dpserve.router.job_records import JobRecord
from dpserve.router.leases import Leases
from dpserve.router.pool import ReplicaPool
from dpserve.router.replica import Replica, Slot
from dpserve.router.usage import Work
from dpserve.router.video_lookup import (
    TRANSFER_TIMEOUT_S,
    JobLookup,
    Watch,
    delete_request,
    get_request,
    job_of,
)
from dpserve.sources.outstore import StoreDown, VideoObjects

log = logging.getLogger(__name__)

MAX_ATTEMPTS: Final = 3
EXPIRY_SWEEP_S: Final = 60.0  # between two looks for expired jobs in the store
HAND_OVER_S: Final = 5.0  # a stopping router's last writes: its leases end now
# Refusals that say "this replica, not this job": the next one may take it.
_PASS_ON: Final = frozenset({p.OVERLOADED, p.UNAVAILABLE})


class VideoJobs(JobLookup):
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
        self._watches: dict[str, Watch] = {}
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
            self.pool.loras.learn(params.lora)
            watch = Watch(job_id, params, created_at, blobs, slot, replica.boot_id, job, tenant)
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
        return job_of(reply, replica)

    async def _record(self, watch: Watch, job: video.VideoJob) -> None:
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
                await self._ask(replica, delete_request(watch.job_id))
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

    def _watch(self, watch: Watch) -> None:
        self._watches[watch.job_id] = watch
        watch.task = asyncio.create_task(self._follow(watch), name=f"video {watch.job_id}")

    async def _follow(self, watch: Watch) -> None:
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

    async def _look(self, watch: Watch) -> bool:
        """One poll of the job; True when the watch is over."""
        await self._delete_stale(watch)
        if watch.slot is None:
            return await self._rerun(watch)
        holder = watch.slot.replica
        if self._lost(holder, watch.boot):
            why = "it left the pool, stopped answering or restarted"
            return await self._lose(watch, why, may_return=holder.boot_id == watch.boot)
        try:
            job = job_of(await self._ask(holder, get_request(watch.job_id)), holder)
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

    async def _lose(self, watch: Watch, why: str, may_return: bool) -> bool:
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

    async def _uploaded(self, watch: Watch) -> bool:
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

    async def _rerun(self, watch: Watch) -> bool:
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
                await self._ask(slot.replica, delete_request(watch.job_id))
            return True
        return False

    async def _give_up(self, watch: Watch, why: str) -> None:
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
        watch = Watch(
            job_id, record.params, job.created_at, blobs, None, record.boot, job, job.tenant
        )
        watch.attempt = job.attempt
        if replica is not None and not self._lost(replica, record.boot):
            watch.slot = self.pool.admission.take(replica, record.params)
        else:
            watch.lost, watch.lost_at = (replica, record.boot), time.monotonic()
            watch.lost_endpoint = record.holder
            # Unreachable, not restarted: it may come back holding the job, as for a
            # watch of this router's own (_lose).
            watch.may_return = replica is not None and replica.boot_id == record.boot
            if await self._uploaded(watch):
                return
        self._watch(watch)

    async def _delete_stale(self, watch: Watch) -> None:
        """A holder that came back after the job ran again elsewhere drops its copy."""
        for replica, boot in list(watch.stale):
            if not self.pool.membership.holds(replica) or replica.boot_id != boot:
                watch.stale.remove((replica, boot))  # restarted or gone: no copy left
            elif replica.answering:
                with contextlib.suppress(ReplicaLost, TimeoutError, p.RequestError):
                    await self._ask(replica, delete_request(watch.job_id))
                    log.info("video job %s: the copy on %s is deleted", watch.job_id, replica.name)
                watch.stale.remove((replica, boot))


def _shape(params: p.GenerateParams, replica: Replica) -> str:
    """What the estimate was of, with the replica's defaults for what the job left out."""
    cost = replica.cost
    width, height = params.width or cost.default_width, params.height or cost.default_height
    frames = (params.video.num_frames if params.video else None) or cost.default_frames
    steps = params.num_inference_steps or cost.default_steps
    return f"{width}x{height}, {frames} frames, {steps} steps"


def _given_up(job: video.VideoJob) -> bool:
    """Failed because its replica shut down before running it: not the job's fault."""
    return job.status == video.FAILED and job.error is not None and job.error.code in _PASS_ON
