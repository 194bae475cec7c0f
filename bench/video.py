"""Video jobs on `dpserve serve --dp-size 2` with the tiny video model, one run.

- ``video_pair_ratio``: the wall time of two concurrent jobs (submit to both done)
  divided by one job's: ≈1 when the two replicas run them in parallel, ≈2 when they
  serialize (bench/dp_pair.py's measure, for jobs).
- ``job_overhead_ms``: what the job API adds to a lone job: submit to done, minus the
  replica's own pipeline and encode times (the job's ``inference_time_s`` and
  ``encode_time_s``). It includes the client's polling interval (``--poll-ms``, half of
  it on average) and the replica's queue time.
- ``encode_frac``: the share of a job's replica time spent encoding the mp4 and
  thumbnail (encode / (inference + encode)).

Rounds where other processes used more than MAX_FOREIGN cores are discarded.
Last line: ``video_pair_ratio=<x> job_overhead_ms=<y> encode_frac=<z>``.
"""

from __future__ import annotations

import argparse
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import cached_model, median, timed_round
from bench.dp_pair import Serve

MAX_FOREIGN = 0.15


def run_job(http: httpx.Client, body: dict[str, Any], poll_s: float) -> tuple[float, Any]:
    """Submit, poll to the end; the wall time and the finished job."""
    start = time.perf_counter()
    submitted = http.post("/v1/videos", json=body)
    submitted.raise_for_status()
    job_id = submitted.json()["id"]
    while True:
        job = http.get(f"/v1/videos/{job_id}").json()
        if job["status"] in ("completed", "failed", "cancelled"):
            break
        time.sleep(poll_s)
    wall = time.perf_counter() - start
    if job["status"] != "completed":
        raise RuntimeError(f"job {job_id} ended {job['status']}: {job.get('error')}")
    http.delete(f"/v1/videos/{job_id}")  # keep the replicas' disks tidy
    return wall, job


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--size", default="128x96")
    parser.add_argument("--frames", type=int, default=33)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--poll-ms", type=float, default=20.0)
    args = parser.parse_args()
    model = cached_model("video")
    body = {
        "prompt": "a lighthouse in a storm",
        "size": args.size,
        "num_frames": args.frames,
        "num_inference_steps": args.steps,
        "seed": 11,
    }
    poll_s = args.poll_ms / 1000
    serve = Serve(model, 2, ["--threads-per-rank", "1"])
    ratios: list[float] = []
    overheads: list[float] = []
    encode: list[float] = []
    dropped = 0
    try:
        with ThreadPoolExecutor(2) as pool:
            for _ in range(2):  # warm the HTTP path and both replicas
                list(pool.map(lambda _: run_job(serve.http, body, poll_s), range(2)))
            for _ in range(args.rounds):
                procs = serve.processes()
                single, f1, (_, job) = timed_round(procs, lambda: run_job(serve.http, body, poll_s))
                pair, f2, _ = timed_round(
                    procs,
                    lambda: list(pool.map(lambda _: run_job(serve.http, body, poll_s), (0, 1))),
                )
                pipeline_s, encode_s = job["inference_time_s"], job["encode_time_s"]
                replica_s = pipeline_s + encode_s
                print(
                    f"single={single:.3f}s pair={pair:.3f}s pipeline={pipeline_s:.3f}s "
                    f"encode={encode_s:.3f}s",
                    file=sys.stderr,
                )
                if max(f1, f2) > MAX_FOREIGN:
                    dropped += 1
                    continue
                ratios.append(pair / single)
                overheads.append((single - replica_s) * 1000)
                encode.append(encode_s / replica_s)
    finally:
        serve.close()
    print(f"model=video size={args.size} frames={args.frames} steps={args.steps} "
          f"rounds={args.rounds} poll_ms={args.poll_ms:g}")  # fmt: skip
    print(f"rounds dropped for a noisy neighbour: {dropped}")
    print(
        f"video_pair_ratio={median(ratios):.2f} job_overhead_ms={median(overheads):.1f} "
        f"encode_frac={median(encode):.3f}"
    )


if __name__ == "__main__":
    main()
