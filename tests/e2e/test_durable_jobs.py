"""A video job outlives the router that placed it and the replica that ran it
(issue 29, docs/outputs.md "Videos"): two routers, `dpserve serve --dp-size 2` and a
second `dpserve router`, share one S3 output store; the second places a job and is
SIGKILLed with the job's replica while it runs. Serve's router answers the job all
along, runs it again (attempt 2) and completes it; its video downloads; the webhook
receiver gets one event for it, which the openai client verifies.

Real parts only: the S3 server of tests/storage/s3.py, the tiny video model, router
and replica processes, a receiver on a real socket.
"""

from __future__ import annotations

import base64
import json
import os
import signal
from collections.abc import Callable
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
# Steps enough that the job still runs when both processes are killed (about 4 s on
# a CPU), few enough that its re-run ends quickly.
JOB: dict[str, Any] = {
    "prompt": "a paper boat",
    "size": "64x48",
    "num_frames": 9,
    "seed": 7,
    "fps": 8,
    "num_inference_steps": 40,
}


def test_a_job_outlives_its_router_and_its_replica(
    s3_server: S3Server, aws_env: dict[str, str], tiny_video_model: Path, tmp_path: Path
) -> None:
    bucket = s3_server.new_bucket("durable")
    secret = tmp_path / "webhook.secret"
    secret.write_text(SECRET + "\n")
    with receiving(Receiver()) as receiver:
        shared = ["--output-store", f"s3://{bucket}/fleet", "--video-poll", "0.2"]
        shared += ["--webhook-url", receiver.url, "--webhook-secret-file", str(secret)]
        with ServeProcess(tiny_video_model, 2, *shared, timeout_s=90) as serve:
            cmd = serve.replica_supervisor(0).cmdline()
            wire = ["--wire-key-file", cmd[cmd.index("--wire-key-file") + 1]]
            drivers = [f"tcp://127.0.0.1:{serve.scheduler_port + r}" for r in range(2)]
            with RouterProcess(drivers, *wire, *shared) as second:
                job_id = _placed_and_running(second.http)
                owner = job_owner(job_id)
                assert owner is not None
                replica = drivers.index(owner.endpoint)
                supervisor = serve.replica_supervisor(replica)
                os.kill(second.proc.pid, signal.SIGKILL)
                for proc in [*supervisor.children(recursive=True), supervisor]:
                    os.kill(proc.pid, signal.SIGKILL)
                second.proc.wait(10)
            seen: list[str] = []

            def completed() -> dict[str, Any] | None:
                got = serve.http.get(f"/v1/videos/{job_id}")
                if got.status_code == 503:  # a replica it asked did not answer: "retry"
                    seen.append("503")
                    return None
                assert got.status_code == 200, got.text  # never a 404: fails at once
                job: dict[str, Any] = got.json()
                seen.append(job["status"])
                return job if job["status"] == "completed" else None

            done = _watching(completed, 60, "the job to complete through serve's router")
            assert set(seen) <= {"503", "queued", "in_progress", "completed"}, seen
            print(f"serve's router answered {seen.count('503')} of {len(seen)} looks with 503")
            assert done["attempt"] == 2, done
            video = serve.http.get(f"/v1/videos/{job_id}/content")
            assert video.status_code == 200, video.text
            stored = s3_server.client().get_object(
                Bucket=bucket, Key=f"fleet/videos/{job_id}/2.mp4"
            )
            assert video.content[4:8] == b"ftyp" and video.content == stored["Body"].read()
            eventually(lambda: _for(receiver, job_id), 30, "the job's event")
        deliveries = _for(receiver, job_id)
    assert {d.headers["webhook-id"] for d in deliveries} == {deliveries[0].headers["webhook-id"]}
    client = openai.OpenAI(api_key="unused", base_url="http://127.0.0.1:9")
    for delivery in deliveries:
        event = client.webhooks.unwrap(delivery.body, delivery.headers, secret=SECRET)
        assert event.type == "video.completed"
        assert json.loads(delivery.body)["id"] == delivery.headers["webhook-id"]


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


def _for(receiver: Receiver, job_id: str) -> list[Delivery]:
    return [d for d in receiver.got if json.loads(d.body)["data"]["id"] == job_id]
