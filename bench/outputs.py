"""What a ``url`` answer through an S3 output store costs against ``b64_json``.

Backend: bench/stub_driver.py answering instantly with one 512² PNG of noise (about
the bytes of a photo-like image that size), a ``dpserve router`` process with
``--output-store s3://BUCKET/bench`` and the real S3 server of tests/storage/s3.py
(built once by tests/storage/build.sh), reached through the ``AWS_*`` variables. The
diffusion is missing on purpose: what is timed is what the store adds per image.

Sequential requests alternate ``b64_json`` and ``url`` (each with its link
downloaded over plain HTTP, as a client then does), after a warm-up. The last line:
``b64_ms=<a> url_ms=<b> url_fetched_ms=<c> png_kib=<k> url_ratio=<b/a>
url_fetched_ratio=<c/a>`` (medians per image).
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
from dpserve.plumbing.ports import free_port
from tests.storage.s3 import build_server, running_s3

HERE = Path(__file__).resolve().parent
GEN = "/v1/images/generations"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=100, help="timed requests of each kind")
    parser.add_argument("--side", type=int, default=512)
    args = parser.parse_args()
    body = {"prompt": "x", "size": f"{args.side}x{args.side}", "num_inference_steps": 1}
    with running_s3(build_server()) as s3:
        bucket = s3.new_bucket("bench")
        zmq_port, http_port = free_port(), free_port()
        url = f"http://127.0.0.1:{http_port}"
        env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")} | s3.env()
        stub = subprocess.Popen(
            [sys.executable, str(HERE / "stub_driver.py"), "--port", str(zmq_port),
             "--side", str(args.side)],
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
                for i in range(10 + args.rounds):  # the first 10 warm every path
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
    print(
        f"b64_ms={b64_ms:.1f} url_ms={url_ms:.1f} url_fetched_ms={fetched_ms:.1f} "
        f"png_kib={size / 1024:.0f} url_ratio={url_ms / b64_ms:.2f} "
        f"url_fetched_ratio={fetched_ms / b64_ms:.2f}"
    )


if __name__ == "__main__":
    main()
