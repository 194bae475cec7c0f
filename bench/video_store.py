"""What the output store adds between a video's last denoising step and its first
downloadable byte, against the replica's own disk.

Backend: ``dpserve serve --dp-size 1`` with the tiny video model, once with
``--output-store s3://BUCKET/bench`` (the real S3 server of tests/storage/s3.py,
reached through the ``AWS_*`` variables) and once without. Each job is polled every
5 ms: its last step is when its progress first reads 95 (the denoising share), its
first byte when ``GET /v1/videos/{id}/content`` first answers 200. Between the two:
the VAE decode, the mp4 and thumbnail, the upload (with the store), the content
read. Last line: ``local_ms=<a> store_ms=<b> store_ratio=<b/a> mp4_kib=<k>``
(medians over ``--jobs``).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests.servers import ServeProcess
from tests.storage.s3 import build_server, running_s3

JOB = {"prompt": "a paper boat", "size": "128x96", "num_frames": 17, "seed": 7, "fps": 8}


def _first_byte_after_last_step(serve: ServeProcess, steps: int) -> tuple[float, int]:
    made = serve.http.post("/v1/videos", json={**JOB, "num_inference_steps": steps})
    made.raise_for_status()
    job_id = made.json()["id"]
    deadline = time.monotonic() + 120
    last_step = None
    while time.monotonic() < deadline:
        if last_step is None:
            job = serve.http.get(f"/v1/videos/{job_id}").json()
            if job["progress"] >= 95 or job["status"] == "completed":
                last_step = time.perf_counter()
        if last_step is not None:
            got = serve.http.get(f"/v1/videos/{job_id}/content")
            if got.status_code == 200:
                return time.perf_counter() - last_step, len(got.content)
        time.sleep(0.005)
    raise TimeoutError(f"video {job_id} not downloadable in 120 s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--jobs", type=int, default=5, help="timed jobs each way")
    parser.add_argument("--steps", type=int, default=4)
    args = parser.parse_args()
    model = Path(tempfile.mkdtemp(prefix="dpserve-bench-video-")) / "tiny-video"
    subprocess.run(
        [sys.executable, "-m", "dpserve", "make-tiny-model", "--variant", "video", str(model)],
        check=True,
        capture_output=True,
    )
    times: dict[str, list[float]] = {"local": [], "store": []}
    size = 0
    with running_s3(build_server()) as s3:
        for name in [n for n in os.environ if n.startswith("AWS_")]:
            del os.environ[name]
        os.environ.update(s3.env())
        store = ("--output-store", f"s3://{s3.new_bucket('bench')}/bench")
        for kind, flags in (("local", ()), ("store", store)):
            with ServeProcess(model, 1, *flags, timeout_s=180) as serve:
                for i in range(1 + args.jobs):  # the first warms every path
                    took, size = _first_byte_after_last_step(serve, args.steps)
                    if i:
                        times[kind].append(took)
    local_ms, store_ms = (1000 * statistics.median(times[k]) for k in ("local", "store"))
    print(
        f"local_ms={local_ms:.1f} store_ms={store_ms:.1f} "
        f"store_ratio={store_ms / local_ms:.2f} mp4_kib={size / 1024:.0f}"
    )


if __name__ == "__main__":
    main()
