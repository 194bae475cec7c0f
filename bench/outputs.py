"""What the output store costs and what it survives (issue 29), in three sections
(``--sections``, default all; ``--quick`` shrinks each to a smoke run):

``url``: a ``url`` answer through an S3 output store against ``b64_json``. Backend:
bench/stub_driver.py answering instantly with one 512² PNG of noise (about the bytes
of a photo-like image that size) and a ``dpserve router`` with ``--output-store
s3://BUCKET/bench``; the diffusion is missing on purpose: what is timed is what the
store adds per image. Sequential requests alternate ``b64_json`` and ``url`` (each
with its link downloaded over plain HTTP, as a client then does), after a warm-up.
Figures (medians per image): ``b64_ms url_ms url_fetched_ms png_kib url_ratio
url_fetched_ratio``.

``events``: a video's last denoising step to its ``video.completed`` event and to its
first downloadable byte, over the job's inference time (bench/output_events.py).
Figures: ``event_ms first_byte_ms infer_ms event_ratio first_byte_ratio``.

``chaos``: video jobs through random live routers while replicas and routers are
SIGKILLed (bench/output_chaos.py). Figures: ``jobs jobs_lost events_doubled
events_missing duplicate_deliveries bad_signatures kills`` (expected: nothing lost,
nothing doubled, nothing missing).

The store is the real S3 server of tests/storage/s3.py (built once by
tests/storage/build.sh), reached through the ``AWS_*`` variables; the processes'
logs go to a file the first lines name. The last line holds every figure.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import wait_ready
from bench.output_chaos import chaos
from bench.output_events import Fleet, event_and_first_byte, fleet
from dpserve.plumbing.ports import free_port
from tests.storage.s3 import S3Server, build_server, running_s3

HERE = Path(__file__).resolve().parent
GEN = "/v1/images/generations"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--sections", default="url,events,chaos", help="comma-separated")
    parser.add_argument("--quick", action="store_true", help="a smoke run of each section")
    parser.add_argument("--rounds", type=int, default=100, help="url: timed requests each kind")
    parser.add_argument("--side", type=int, default=512, help="url: the image's side")
    parser.add_argument("--video-jobs", type=int, default=5, help="events: timed jobs")
    parser.add_argument("--steps", type=int, default=20, help="events: a video's steps")
    parser.add_argument("--video-poll", type=float, default=0.2, help="events, chaos: routers'")
    parser.add_argument("--chaos-jobs", type=int, default=24)
    parser.add_argument("--chaos-steps", type=int, default=100, help="a job's steps (1-100)")
    parser.add_argument("--chaos-s", type=float, default=120.0, help="how long the killer runs")
    parser.add_argument("--kill-every", type=float, default=5.0, help="seconds, on average")
    parser.add_argument("--settle-s", type=float, default=240.0, help="then, for jobs to end")
    args = parser.parse_args()
    if args.quick:
        args.rounds, args.video_jobs, args.chaos_jobs, args.chaos_s = 10, 1, 6, 30.0
    sections = set(args.sections.split(","))
    figures: dict[str, float] = {}
    with running_s3(build_server()) as s3:
        if "url" in sections:
            figures |= url_against_b64(s3, args.rounds, args.side)
        for name, run in (("events", _events), ("chaos", _chaos)):
            if name in sections:
                with fleet(s3, args.video_poll) as hooked:
                    print(f"{name}: process logs in {hooked.log}", flush=True)
                    figures |= run(hooked, args)
    print(" ".join(f"{k}={_show(v)}" for k, v in figures.items()))


def _events(hooked: Fleet, args: argparse.Namespace) -> dict[str, float]:
    return event_and_first_byte(hooked, args.video_jobs, args.steps)


def _chaos(hooked: Fleet, args: argparse.Namespace) -> dict[str, float]:
    return chaos(
        hooked, args.chaos_jobs, args.chaos_s, args.kill_every, args.settle_s, args.chaos_steps
    )


def _show(value: float) -> str:
    return str(value) if isinstance(value, int) else f"{value:.2f}"


def url_against_b64(s3: S3Server, rounds: int, side: int) -> dict[str, float]:
    body = {"prompt": "x", "size": f"{side}x{side}", "num_inference_steps": 1}
    bucket = s3.new_bucket("bench")
    zmq_port, http_port = free_port(), free_port()
    url = f"http://127.0.0.1:{http_port}"
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")} | s3.env()
    stub = subprocess.Popen(
        [sys.executable, str(HERE / "stub_driver.py"), "--port", str(zmq_port),
         "--side", str(side)],
    )  # fmt: skip
    router = subprocess.Popen(
        [sys.executable, "-m", "dpserve", "router", "--worker", f"tcp://127.0.0.1:{zmq_port}",
         "--port", str(http_port), "--output-store", f"s3://{bucket}/bench"],
        env=env,
    )  # fmt: skip
    try:
        wait_ready(url, proc=router)
        times: dict[str, list[float]] = {"b64": [], "url": [], "fetched": []}
        size = 0
        with httpx.Client(base_url=url, timeout=60) as http, httpx.Client(timeout=60) as web:
            for i in range(10 + rounds):  # the first 10 warm every path
                start = time.perf_counter()
                inline = http.post(GEN, json=body)
                inline.raise_for_status()
                b64 = time.perf_counter() - start
                start = time.perf_counter()
                made = http.post(GEN, json={**body, "response_format": "url"})
                made.raise_for_status()
                answered = time.perf_counter() - start
                got = web.get(made.json()["data"][0]["url"])
                got.raise_for_status()
                fetched = time.perf_counter() - start
                size = len(got.content)
                if i >= 10:
                    times["b64"].append(b64)
                    times["url"].append(answered)
                    times["fetched"].append(fetched)
    finally:
        for proc in (router, stub):
            proc.terminate()
            proc.wait(timeout=30)
    b64_ms, url_ms, fetched_ms = (1000 * statistics.median(times[k]) for k in times)
    return {
        "b64_ms": b64_ms,
        "url_ms": url_ms,
        "url_fetched_ms": fetched_ms,
        "png_kib": size / 1024,
        "url_ratio": url_ms / b64_ms,
        "url_fetched_ratio": fetched_ms / b64_ms,
    }


if __name__ == "__main__":
    main()
