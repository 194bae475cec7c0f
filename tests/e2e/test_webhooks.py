"""Webhooks end to end: `dpserve serve` with the real tiny video model posts a signed
`video.completed` to a receiver on a real socket, which the official openai client
verifies; a bad secret file stops the start with exit code 2 (docs/webhooks.md)."""

from __future__ import annotations

import base64
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import openai
import pytest

from tests.servers import ServeProcess
from tests.webhook_receiver import Receiver, receiving

pytestmark = pytest.mark.e2e

SECRET = "whsec_" + base64.b64encode(os.urandom(32)).decode()
JOB = {"prompt": "a paper boat", "size": "64x48", "num_frames": 5, "num_inference_steps": 2}


def test_serve_posts_a_signed_completed_event_the_openai_client_verifies(
    tiny_video_model: Path, tmp_path: Path
) -> None:
    secret = tmp_path / "webhook.secret"
    secret.write_text(SECRET + "\n")
    with receiving(Receiver()) as receiver:
        hook = ("--webhook-url", receiver.url, "--webhook-secret-file", str(secret))
        with ServeProcess(tiny_video_model, 1, *hook, timeout_s=120) as serve:
            made = serve.http.post("/v1/videos", json=JOB)
            assert made.status_code == 200, made.text
            job_id = made.json()["id"]
            deadline = time.monotonic() + 60
            while (job := serve.http.get(f"/v1/videos/{job_id}").json())["status"] != "completed":
                assert job["status"] in ("queued", "in_progress"), job
                assert time.monotonic() < deadline
                time.sleep(0.05)
            seen = time.monotonic()
            while not receiver.got:
                assert time.monotonic() < deadline, "no event arrived"
                time.sleep(0.02)
            (delivery,) = receiver.got
            print(f"event {1000 * (delivery.at - seen):.0f} ms after the client saw it done")
    client = openai.OpenAI(api_key="unused", base_url="http://127.0.0.1:9")
    event = client.webhooks.unwrap(delivery.body, delivery.headers, secret=SECRET)
    assert event.type == "video.completed"
    body = json.loads(delivery.body)
    assert body["data"] == {"id": job_id} and body["object"] == "event"
    assert delivery.headers["webhook-id"] == body["id"]


def test_a_bad_secret_file_stops_serve_with_exit_2(tmp_path: Path) -> None:
    secret = tmp_path / "webhook.secret"
    secret.write_text("not-a-whsec-secret\n")
    argv = ["serve", "--model", str(tmp_path), "--webhook-url", "http://127.0.0.1:9/h"]
    done = subprocess.run(
        [sys.executable, "-m", "dpserve", *argv, "--webhook-secret-file", str(secret)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2, done.stderr
    assert "does not hold a Standard Webhooks secret" in done.stderr
    assert "not-a-whsec-secret" not in done.stderr
