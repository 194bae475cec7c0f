"""The video half of bench/outputs.py: a fleet whose routers share an S3 output store
and a signed webhook receiver, and the time from a video's last denoising step to
its ``video.completed`` event and to its first downloadable byte.

Last step and first byte are read as bench/video_store.py reads them (the job polled
every 5 ms: its progress first at 95, its content first answering 200); the event's
time is when the receiver got it. Both are told as ratios to the job's own inference
time (the pipeline, without encoding: what the client waited for anyway).
"""

from __future__ import annotations

import base64
import contextlib
import json
import os
import statistics
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import openai

from bench.common import cached_model
from tests.servers import ServeProcess
from tests.storage.s3 import S3Server
from tests.webhook_receiver import Delivery, Receiver, receiving

# A few seconds on a CPU: small frames, steps enough that a kill lands mid-run.
JOB = {"prompt": "a paper boat", "size": "64x48", "num_frames": 9, "fps": 8}


@dataclass(frozen=True)
class Fleet:
    """What every router and replica of a run shares: the tiny video model, the flags
    naming the store, the poll and the webhook, the receiver, and where logs go."""

    model: Path
    flags: list[str]
    receiver: Receiver
    secret: str
    log: Path

    def events(self, job_id: str) -> list[Delivery]:
        return [d for d in self.receiver.got if json.loads(d.body)["data"]["id"] == job_id]

    def verified(self, delivery: Delivery) -> bool:
        """Whether the openai client accepts the delivery's signature, as of when it came
        (its timestamp's tolerance counts from then, not from the end of the run)."""
        client = openai.OpenAI(api_key="unused", base_url="http://127.0.0.1:9")
        age = time.monotonic() - delivery.at
        try:
            client.webhooks.verify_signature(
                delivery.body, delivery.headers, secret=self.secret, tolerance=int(age) + 300
            )
        except openai.InvalidWebhookSignatureError:
            return False
        return True


@contextlib.contextmanager
def fleet(s3: S3Server, poll_s: float) -> Iterator[Fleet]:
    """A fresh bucket and receiver; the ``AWS_*`` variables of this process (and so of
    the processes it starts) point at ``s3``."""
    for name in [n for n in os.environ if n.startswith("AWS_")]:
        del os.environ[name]
    os.environ.update(s3.env())
    folder = Path(tempfile.mkdtemp(prefix="dpserve-bench-outputs-"))
    secret = "whsec_" + base64.b64encode(os.urandom(32)).decode()
    (folder / "webhook.secret").write_text(secret + "\n")
    with receiving(Receiver()) as receiver:
        flags = ["--output-store", f"s3://{s3.new_bucket('bench')}/fleet"]
        flags += ["--video-poll", str(poll_s), "--webhook-url", receiver.url]
        flags += ["--webhook-secret-file", str(folder / "webhook.secret")]
        yield Fleet(cached_model("video"), flags, receiver, secret, folder / "processes.log")


def event_and_first_byte(fleet: Fleet, jobs: int, steps: int) -> dict[str, float]:
    """Medians over ``jobs`` (after one that warms every path), one replica: ms from the
    last step to the event and to the first byte, and each over the inference time."""
    took: dict[str, list[float]] = {"event": [], "byte": [], "infer": []}
    with ServeProcess(fleet.model, 1, *fleet.flags, timeout_s=180, log=fleet.log) as serve:
        for i in range(1 + jobs):
            made = serve.http.post("/v1/videos", json={**JOB, "num_inference_steps": steps})
            made.raise_for_status()
            job_id = made.json()["id"]
            deadline = time.monotonic() + 120
            last_step = first_byte = None
            while first_byte is None or not fleet.events(job_id):
                if time.monotonic() > deadline:
                    raise TimeoutError(f"video {job_id}: no content and event in 120 s")
                if last_step is None:
                    job = serve.http.get(f"/v1/videos/{job_id}").json()
                    if job["progress"] >= 95 or job["status"] == "completed":
                        last_step = time.monotonic()
                elif first_byte is None and _downloadable(serve, job_id):
                    first_byte = time.monotonic()
                time.sleep(0.005)
            assert last_step is not None
            if i:
                took["event"].append(fleet.events(job_id)[0].at - last_step)
                took["byte"].append(first_byte - last_step)
                done = serve.http.get(f"/v1/videos/{job_id}").json()
                took["infer"].append(done["inference_time_s"])
    event, byte, infer = (1000 * statistics.median(took[k]) for k in ("event", "byte", "infer"))
    return {
        "event_ms": event,
        "first_byte_ms": byte,
        "infer_ms": infer,
        "event_ratio": event / infer,
        "first_byte_ratio": byte / infer,
    }


def _downloadable(serve: ServeProcess, job_id: str) -> bool:
    return serve.http.get(f"/v1/videos/{job_id}/content").status_code == 200
