"""The chaos run of bench/outputs.py: video jobs submitted through random live routers
while a killer SIGKILLs a random replica or router every few seconds; then every job
a client got an id for must complete with downloadable content, and its webhook
receiver must hold one event for it (issue 29, "Nothing lost, nothing doubled").

The fleet: ``dpserve serve --dp-size 2`` (its supervisor restarts a killed replica,
with its crash backoff) and two more ``dpserve router`` processes over the
same replicas, all sharing one S3 output store and webhook (bench/output_events.py).
The killer's targets are the replicas and the extra routers (a killed router is
started again, on a new port); serve's own router stays, since killing it is killing
serve. The killer stops when the chaos does; then each job is followed (bounded) to
its end through random live routers.

Figures: ``jobs_lost`` (an id that answered 404, or did not end completed with an mp4
to download), ``events_doubled`` (a job with more than one distinct event id: the id
is stable per job and type, so two ``completed`` events, or a ``completed`` and a
``failed``), ``events_missing`` (a completed job with no ``video.completed`` event),
``duplicate_deliveries`` (repeats of an id already delivered: allowed, at least
once), ``bad_signatures`` (deliveries the openai client refuses), ``kills``.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import threading
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field

import httpx
import psutil

from bench.output_events import Fleet
from tests.servers import RouterProcess, ServeProcess

DONE = ("completed", "failed", "cancelled")
# About 2 s of inference on a free CPU core at 100 steps: a kill often lands mid-run.
JOB = {"prompt": "a paper boat", "size": "128x96", "num_frames": 17, "fps": 8}


@dataclass
class Routers:
    """The live routers; the killer replaces one while clients pick among the others."""

    serve: ServeProcess
    args: list[str]
    fleet: Fleet
    extra: list[RouterProcess] = field(default_factory=list)
    killed: list[RouterProcess] = field(default_factory=list)  # clients may still hold them
    lock: threading.Lock = field(default_factory=threading.Lock)

    def pick(self, rng: random.Random) -> httpx.Client:
        with self.lock:
            return rng.choice([self.serve.http, *(r.http for r in self.extra)])

    def start(self) -> None:
        router = RouterProcess(self._drivers(), *self.args, log=self.fleet.log)
        with self.lock:
            self.extra.append(router)

    def kill(self, router: RouterProcess) -> None:
        with self.lock:
            self.extra.remove(router)
        os.kill(router.proc.pid, signal.SIGKILL)
        router.proc.wait()
        self.killed.append(router)

    def close(self) -> None:
        for router in [*self.extra, *self.killed]:
            router.close()

    def _drivers(self) -> list[str]:
        return [f"tcp://127.0.0.1:{self.serve.scheduler_port + r}" for r in range(2)]


@dataclass
class Tally:
    kills: Counter[str] = field(default_factory=Counter)
    refused: int = 0  # submissions no router took (all tried, or a transport error)
    unavailable: int = 0  # 503 answers to a look at a job (asked replica did not answer)


class Killer(threading.Thread):
    """Every ``every_s``, SIGKILLs one of: a replica (every process of it), an extra
    router (started again at once)."""

    def __init__(self, routers: Routers, every_s: float, rng: random.Random, tally: Tally) -> None:
        super().__init__(daemon=True)
        self.routers, self.every_s, self.rng, self.tally = routers, every_s, rng, tally
        self.stop = threading.Event()

    def run(self) -> None:
        while not self.stop.wait(self.every_s * self.rng.uniform(0.5, 1.5)):
            targets: list[int | RouterProcess] = [0, 1, *self.routers.extra]
            target = self.rng.choice(targets)
            if isinstance(target, RouterProcess):
                self.routers.kill(target)
                self.tally.kills["router"] += 1
                with contextlib.suppress(RuntimeError):  # not ready in time: the next kill
                    self.routers.start()
            elif self._kill_replica(target):
                self.tally.kills["replica"] += 1

    def _kill_replica(self, replica: int) -> bool:
        try:
            supervisor = self.routers.serve.replica_supervisor(replica)
            procs = [*supervisor.children(recursive=True), supervisor]
        except (LookupError, psutil.Error):  # in its restart backoff
            return False
        for proc in procs:
            with contextlib.suppress(ProcessLookupError):
                os.kill(proc.pid, signal.SIGKILL)
        return True


def chaos(
    fleet: Fleet, jobs: int, chaos_s: float, kill_every_s: float, settle_s: float, steps: int
) -> dict[str, float]:
    rng = random.Random(29)  # the clients'; the killer's thread has its own
    tally = Tally()
    with _routers(fleet) as routers:
        killer = Killer(routers, kill_every_s, random.Random(30), tally)
        killer.start()
        began = time.monotonic()
        ids: list[str] = []
        for n in range(jobs):
            wait = began + n * chaos_s / jobs - time.monotonic()
            time.sleep(max(0.0, wait))  # jobs spread evenly over the chaos
            job_id = _submit(routers, rng, steps)
            if job_id is None:
                tally.refused += 1
            else:
                ids.append(job_id)
        killer.stop.wait(max(0.0, began + chaos_s - time.monotonic()))
        killer.stop.set()
        killer.join()
        lost = _follow(routers, rng, ids, settle_s, tally)
        completed = [i for i in ids if i not in lost]
        deadline = time.monotonic() + 60  # events of completed jobs still on their way
        while time.monotonic() < deadline and not all(fleet.events(i) for i in completed):
            time.sleep(0.2)
    per_job = {i: fleet.events(i) for i in ids}
    distinct = {i: {d.headers["webhook-id"] for d in got} for i, got in per_job.items()}
    kinds = {i: {json.loads(d.body)["type"] for d in got} for i, got in per_job.items()}
    deliveries = [d for got in per_job.values() for d in got]
    print(
        f"chaos: {len(ids)} jobs placed ({tally.refused} submissions refused), "
        f"kills {dict(tally.kills)}, {tally.unavailable} looks answered 503, "
        f"lost: {dict(Counter(lost.values())) or 'none'}"
    )
    for job_id, why in sorted(lost.items()):
        print(f"chaos: lost {job_id}: {why}")
    return {
        "jobs": len(ids),
        "jobs_lost": len(lost),
        "events_doubled": sum(1 for i in ids if len(distinct[i]) > 1),
        "events_missing": sum(1 for i in completed if "video.completed" not in kinds[i]),
        "duplicate_deliveries": len(deliveries) - sum(len(d) for d in distinct.values()),
        "bad_signatures": sum(1 for d in deliveries if not fleet.verified(d)),
        "kills": sum(tally.kills.values()),
    }


@contextlib.contextmanager
def _routers(fleet: Fleet, extra: int = 2) -> Iterator[Routers]:
    with ServeProcess(fleet.model, 2, *fleet.flags, timeout_s=180, log=fleet.log) as serve:
        cmd = serve.replica_supervisor(0).cmdline()
        wire = ["--wire-key-file", cmd[cmd.index("--wire-key-file") + 1]]
        routers = Routers(serve, [*wire, *fleet.flags], fleet)
        try:
            for _ in range(extra):
                routers.start()
            yield routers
        finally:
            routers.close()


def _submit(routers: Routers, rng: random.Random, steps: int) -> str | None:
    """The id a random live router gave the job; another router on a transport error or
    a 503 (every replica down), for up to 30 s; None if none took it."""
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            made = routers.pick(rng).post(
                "/v1/videos", json={**JOB, "num_inference_steps": steps}, timeout=30
            )
        except httpx.TransportError:
            continue
        if made.status_code == 200:
            return str(made.json()["id"])
        if made.status_code != 503:
            made.raise_for_status()
        time.sleep(0.5)
    return None


def _follow(
    routers: Routers, rng: random.Random, ids: list[str], settle_s: float, tally: Tally
) -> dict[str, str]:
    """The jobs lost, each with why: a 404 at any look, or not completed with an mp4
    by ``settle_s``."""
    lost: dict[str, str] = {}
    waiting = set(ids)
    deadline = time.monotonic() + settle_s
    while waiting and time.monotonic() < deadline:
        for job_id in sorted(waiting):
            http = routers.pick(rng)
            try:
                got = http.get(f"/v1/videos/{job_id}", timeout=30)
                if got.status_code == 503:
                    tally.unavailable += 1
                    continue
                if got.status_code == 404 or got.json()["status"] in DONE:
                    waiting.discard(job_id)
                    if (why := _not_downloadable(http, got)) is not None:
                        lost[job_id] = why
            except httpx.TransportError:
                continue
        time.sleep(0.5)
    for job_id in waiting:
        with contextlib.suppress(httpx.HTTPError, ValueError):
            job = routers.pick(rng).get(f"/v1/videos/{job_id}", timeout=30).json()
            lost[job_id] = f"not ended ({job['status']}, attempt {job['attempt']})"
        lost.setdefault(job_id, "not ended")
    return lost


def _not_downloadable(http: httpx.Client, got: httpx.Response) -> str | None:
    if got.status_code != 200:
        return str(got.status_code)
    job = got.json()
    if job["status"] != "completed":
        return f"{job['status']} ({(job.get('error') or {}).get('code')})"
    content = http.get(f"/v1/videos/{job['id']}/content", timeout=60)
    if content.status_code != 200 or content.content[4:8] != b"ftyp":
        return f"content {content.status_code}"
    return None
