"""Parallel modes of one replica's gang on a video: pipeline time of each 2-rank
layout vs one rank, with a small random-weight Wan-style model (``video-small``:
wide enough that the transformer, not the VAE, carries most of a video's time).

One `serve --dp-size 1` per layout runs at once: ``single``, ``cfg2`` (``--cfg 2``:
the guidance branches, one per rank), ``ulysses2`` and ``ring2`` (``--sp 2``: each
rank holds half of every pass's frames x tokens), ``tp2`` (``--tp 2``: each rank
holds half of every block's weights), one thread per rank. Each round
asks each layout for the same video job in turn (guidance CFG on, Wan's 5.0), so
drift on the machine hits every layout alike and only one gang computes at a time;
``cfg2_plain`` is cfg2 on a job without CFG (``guidance_scale`` 1), whose tokens the
CFG pair splits instead. Times are the replica's own pipeline time of the job
(``inference_time_s``: no queue, encode or polling). Rounds where other processes
used more than MAX_FOREIGN cores are dropped; each figure is a median.

``<layout>=<x>`` is ``t_single / t_layout`` (above 1: faster than one rank).
``tp2_weights`` is the largest per-rank transformer weight bytes of the tp2 gang over
one rank's (each serve's ``/server_info`` ``rank_weights``; with Wan 2.2's two experts,
the first expert's, which tensor parallel splits the same way).
Last line: ``cfg2=<x> ulysses2=<y> ring2=<z> tp2=<v> cfg2_plain=<w> tp2_weights=<r>``
(after ``family=wan`` when ``bench/parallel_modes.py --family wan`` runs it).
"""

from __future__ import annotations

import argparse
import sys
from functools import partial
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import cached_model, median, timed_round
from bench.dp_pair import Serve
from bench.parallel_modes import weight_ratios
from bench.video import run_job

MAX_FOREIGN = 0.15
POLL_S = 0.25  # a lazy client: its GETs reach the driver rank, which computes too
LAYOUTS: dict[str, list[str]] = {
    "single": [],
    "cfg2": ["--cfg", "2"],
    "ulysses2": ["--sp", "2", "--ulysses", "2"],
    "ring2": ["--sp", "2", "--ring", "2"],
    "tp2": ["--tp", "2"],
}


def main(argv: list[str] | None = None, family: str | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--variant", default="video-small")
    parser.add_argument("--size", default="160x128")
    parser.add_argument("--frames", type=int, default=33)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args(argv)
    model = cached_model(args.variant)
    body: dict[str, Any] = {
        "prompt": "a lighthouse in a storm",
        "size": args.size,
        "num_frames": args.frames,
        "num_inference_steps": args.steps,
        "seed": 11,
    }
    plain = {**body, "guidance_scale": 1.0}
    serves = {name: Serve(model, 1, ["--threads-per-rank", "1", *flags])
              for name, flags in LAYOUTS.items()}  # fmt: skip
    times: dict[str, list[float]] = {name: [] for name in [*LAYOUTS, "single_plain", "cfg2_plain"]}
    asks = [(name, name, body) for name in LAYOUTS]
    asks += [("single_plain", "single", plain), ("cfg2_plain", "cfg2", plain)]
    dropped = 0
    try:
        procs = [p for serve in serves.values() for p in serve.processes()]
        for _, layout, job in asks:  # warm each path once
            run_job(serves[layout].http, job, POLL_S)
        for _ in range(args.rounds):
            for name, layout, job in asks:
                ask = partial(run_job, serves[layout].http, job, POLL_S)
                _, foreign, (_, done) = timed_round(procs, ask)
                if foreign > MAX_FOREIGN:
                    dropped += 1
                    continue
                times[name].append(done["inference_time_s"])
        infos = {name: serve.http.get("/server_info").json() for name, serve in serves.items()}
    finally:
        for serve in serves.values():
            serve.close()
    t = {name: median(values) for name, values in times.items()}
    print(f"model={args.variant} size={args.size} frames={args.frames} steps={args.steps} "
          f"rounds={args.rounds} threads_per_rank=1")  # fmt: skip
    print("median pipeline s: " + " ".join(f"{name}={s:.3f}" for name, s in t.items()))
    print(f"measurements dropped for a noisy neighbour: {dropped}")
    print(
        ("" if family is None else f"family={family} ")
        + f"cfg2={t['single'] / t['cfg2']:.2f} ulysses2={t['single'] / t['ulysses2']:.2f} "
        f"ring2={t['single'] / t['ring2']:.2f} tp2={t['single'] / t['tp2']:.2f} "
        f"cfg2_plain={t['single_plain'] / t['cfg2_plain']:.2f} "
        f"tp2_weights={weight_ratios(infos)['tp2']:.2f}"
    )


if __name__ == "__main__":
    main()
