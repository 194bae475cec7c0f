"""Video jobs that outlive the processes that touched them (issue 29, docs/outputs.md
"Jobs that outlive their pods"): `dpserve serve` and a second `dpserve router` over
its replicas share one S3 output store, a 0.2 s video poll and a webhook receiver.

The journey: the second router places a job and is SIGKILLed with the job's replica
while it runs; serve's router answers the job all along (never a 404), takes it
over, runs it again (attempt 2) and completes it; its video downloads (the object
stored for attempt 2); the receiver gets one event id for it, which the openai
client verifies. Then a replica that restarts slower than a lease, both routers
alive: the job still runs again once and completes.

Real parts only: the S3 server of tests/storage/s3.py, the tiny video model, router
and replica processes, a receiver on a real socket.
"""

from __future__ import annotations

import base64
import contextlib
import json
import os
import signal
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import httpx
import openai
import pytest

from dpserve.contract.video import job_owner
from tests.polling import eventually
from tests.servers import RouterProcess, ServeProcess
from tests.storage.s3 import S3Server
from tests.webhook_receiver import Delivery, Receiver, receiving

pytestmark = [pytest.mark.e2e, pytest.mark.s3]
T = TypeVar("T")

SECRET = "whsec_" + base64.b64encode(os.urandom(32)).decode()
# Steps enough that a look every 20 ms catches the job running and the kills land
# before it ends (the most a request may ask: about 0.7 s of inference on a CPU).
JOB: dict[str, Any] = {
    "prompt": "a paper boat",
    "size": "64x48",
    "num_frames": 9,
    "seed": 7,
    "fps": 8,
    "num_inference_steps": 100,
}


@dataclass
class Fleet:
    """`dpserve serve` and a second `dpserve router` over its replicas, sharing one
    output store, poll and webhook receiver."""

    serve: ServeProcess
    second: RouterProcess
    drivers: list[str]
    receiver: Receiver
    s3: S3Server
    bucket: str

    def kill_replica(self, replica: int) -> None:
        supervisor = self.serve.replica_supervisor(replica)
        for proc in [*supervisor.children(recursive=True), supervisor]:
            os.kill(proc.pid, signal.SIGKILL)

    def completed(self, job_id: str, timeout_s: float) -> dict[str, Any]:
        """The job's record once serve's router says completed; never a 404 meanwhile
        (a 503, a replica that did not answer the lookup, says "retry")."""
        seen: list[str] = []

        def completed() -> dict[str, Any] | None:
            got = self.serve.http.get(f"/v1/videos/{job_id}")
            if got.status_code == 503:
                seen.append("503")
                return None
            assert got.status_code == 200, got.text  # never a 404: fails at once
            job: dict[str, Any] = got.json()
            seen.append(job["status"])
            return job if job["status"] == "completed" else None

        done = _watching(completed, timeout_s, f"{job_id} to complete through serve's router")
        assert set(seen) <= {"503", "queued", "in_progress", "completed"}, seen
        print(f"serve's router answered {seen.count('503')} of {len(seen)} looks with 503")
        return done

    def assert_downloadable(self, job_id: str, attempt: int) -> None:
        """Its content is the mp4 stored for ``attempt``."""
        video = self.serve.http.get(f"/v1/videos/{job_id}/content")
        assert video.status_code == 200, video.text
        key = f"fleet/videos/{job_id}/{attempt}.mp4"
        stored = self.s3.client().get_object(Bucket=self.bucket, Key=key)["Body"].read()
        assert video.content[4:8] == b"ftyp" and video.content == stored

    def events(self, job_id: str) -> list[Delivery]:
        """Its deliveries, once one came: one event id, verified by the openai client."""
        eventually(lambda: self._deliveries(job_id), 30, f"{job_id}'s event")
        deliveries = self._deliveries(job_id)
        assert len({d.headers["webhook-id"] for d in deliveries}) == 1, deliveries
        client = openai.OpenAI(api_key="unused", base_url="http://127.0.0.1:9")
        for delivery in deliveries:
            event = client.webhooks.unwrap(delivery.body, delivery.headers, secret=SECRET)
            assert event.type == "video.completed"
            assert json.loads(delivery.body)["id"] == delivery.headers["webhook-id"]
        return deliveries

    def _deliveries(self, job_id: str) -> list[Delivery]:
        return [d for d in self.receiver.got if json.loads(d.body)["data"]["id"] == job_id]


@contextlib.contextmanager
def _fleet(s3: S3Server, model: Path, replicas: int, folder: Path) -> Iterator[Fleet]:
    bucket = s3.new_bucket("durable")
    secret = folder / "webhook.secret"
    secret.write_text(SECRET + "\n")
    with receiving(Receiver()) as receiver:
        shared = ["--output-store", f"s3://{bucket}/fleet", "--video-poll", "0.2"]
        shared += ["--webhook-url", receiver.url, "--webhook-secret-file", str(secret)]
        with ServeProcess(model, replicas, *shared, timeout_s=90) as serve:
            cmd = serve.replica_supervisor(0).cmdline()
            wire = ["--wire-key-file", cmd[cmd.index("--wire-key-file") + 1]]
            drivers = [f"tcp://127.0.0.1:{serve.scheduler_port + r}" for r in range(replicas)]
            with RouterProcess(drivers, *wire, *shared) as second:
                yield Fleet(serve, second, drivers, receiver, s3, bucket)


def test_a_job_outlives_its_router_and_its_replica(
    s3_server: S3Server, aws_env: dict[str, str], tiny_video_model: Path, tmp_path: Path
) -> None:
    with _fleet(s3_server, tiny_video_model, 2, tmp_path) as fleet:
        job_id = _placed_and_running(fleet.second.http)
        owner = job_owner(job_id)
        assert owner is not None
        os.kill(fleet.second.proc.pid, signal.SIGKILL)
        fleet.kill_replica(fleet.drivers.index(owner.endpoint))
        fleet.second.proc.wait(10)
        done = fleet.completed(job_id, 60)
        assert done["attempt"] == 2, done
        fleet.assert_downloadable(job_id, 2)
        fleet.events(job_id)


def test_a_job_whose_only_replica_restarts_slowly_runs_again_once(
    s3_server: S3Server, aws_env: dict[str, str], tiny_video_model: Path, tmp_path: Path
) -> None:
    """Both routers live; the replica's restart outlasts a lease (its crash backoff
    and start-up take longer than max(3 s, 10 polls)). The placing router keeps its
    lease while the job waits for a replica, so one router runs it again, once, and
    tells it once (the chaos helper found both routers running it, and one deleting
    the other's run)."""
    with _fleet(s3_server, tiny_video_model, 1, tmp_path) as fleet:
        job_id = _placed_and_running(fleet.second.http)
        fleet.kill_replica(0)
        done = fleet.completed(job_id, 60)
        assert done["attempt"] == 2, done
        fleet.assert_downloadable(job_id, 2)
        fleet.events(job_id)


def _placed_and_running(http: httpx.Client) -> str:
    made = http.post("/v1/videos", json=JOB)
    assert made.status_code == 200, made.text
    job_id: str = made.json()["id"]

    def running() -> bool:
        job = http.get(f"/v1/videos/{job_id}").json()
        assert job["status"] in ("queued", "in_progress"), job  # still running when killed
        return bool(job["status"] == "in_progress")

    _watching(running, 30, "the job to run", poll_s=0.02)
    return job_id


def _watching(check: Callable[[], T | None], timeout_s: float, what: str, poll_s: float = 0.1) -> T:
    """``eventually``, except that an AssertionError of ``check`` (a 404, a job that
    ended too soon) fails at once: only errors of the transport are waited out."""
    wrong: list[AssertionError] = []

    def look() -> T | bool | None:
        try:
            return check()
        except AssertionError as error:
            wrong.append(error)
            return True  # ends the wait

    got = eventually(look, timeout_s, what, poll_s)
    if wrong:
        raise wrong[0]
    return got  # type: ignore[return-value]  # True only with an error, raised above
