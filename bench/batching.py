"""Dynamic batching: images per second of one replica with --max-batch 4 vs 1, one run.

Two `dpserve worker` replicas with the same settings but --max-batch run side by side;
rounds alternate between them. A round puts a queue of identical-shape requests (one
image each, distinct seeds) on the replica at once over its ZMQ wire and waits for the
last image; images per second = requests / wall time. Rounds where other processes
used more than --max-foreign cores are discarded.

**Default: the small model at 128x128, 8 steps, one thread per rank.** On a CPU the
gain of batching is the per-call work a batch shares (text encoding and the Python
and dispatch cost of each denoiser call, scheduler step and VAE call) plus somewhat
better matmul efficiency at a larger batch; the arithmetic per image stays. The tiny
model at 64x64 is almost nothing but that overhead and would overstate the gain,
while larger sizes drift toward the arithmetic alone on a CPU; 128x128 on the small
model (the size bench/image_api.py measured n=4 against four n=1 at) is in between.
On a GPU, where one small image leaves most of the device idle, the gain should be
larger (run it there with bigger sizes).

Each request is rendered on both replicas with the same seed, so the run also says
how a batched image relates to the same request alone (bytes equal, least PSNR).
Last line: ``batch4_tput_gain=<images/s at --max-batch 4 / at --max-batch 1>``.
"""

from __future__ import annotations

import argparse
import io
import math
import sys
from pathlib import Path

import numpy as np
from PIL import Image

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import cached_model, median, rank_processes, timed_round
from dpserve.contract import protocol as p
from dpserve.local import WorkerProcess


def _queue(worker: WorkerProcess, bodies: list[dict[str, object]]) -> dict[str, p.Message]:
    """Send every request at once, then wait for every answer."""
    with worker.client(timeout_s=600) as client:
        for i, body in enumerate(bodies):
            client.send_raw(p.encode(p.GENERATE, f"r{i}", body))
        replies = {m.id: m for m in (client.recv() for _ in bodies)}
    failed = [m for m in replies.values() if m.kind != p.RESULT]
    if failed:
        raise RuntimeError(f"{failed[0].id}: {p.decode_error(failed[0])}")
    return replies


def _calls(replies: dict[str, p.Message]) -> int:
    """Pipeline calls a round took: a batch's replies share one inference time."""
    return len({m.body_as(p.GenerateResult).inference_time_s for m in replies.values()})


def _psnr(a: bytes, b: bytes) -> float:
    x, y = (np.asarray(Image.open(io.BytesIO(f)).convert("RGB"), np.float64) for f in (a, b))
    mse = float(((x - y) ** 2).mean())
    return math.inf if mse == 0 else 10 * math.log10(255**2 / mse)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--variant", default="small", choices=("tiny", "small"))
    parser.add_argument("--size", type=int, default=128)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--queue", type=int, default=16, help="requests per round")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--max-foreign", type=float, default=0.15, help="cores; else dropped")
    args = parser.parse_args()
    model = cached_model(args.variant)
    extra = ["--threads-per-rank", "1", "--max-sequence-length", "77"]
    workers = {b: WorkerProcess(model, "--max-batch", str(b), *extra) for b in (4, 1)}
    rates: dict[int, list[float]] = {4: [], 1: []}
    calls: dict[int, list[int]] = {4: [], 1: []}
    psnr: list[float] = []
    dropped = 0
    try:
        for round_ in range(-1, args.rounds):  # round -1 warms both replicas' paths
            bodies: list[dict[str, object]] = [
                {
                    "prompt": "a harbour at dawn",
                    "width": args.size,
                    "height": args.size,
                    "num_inference_steps": args.steps,
                    "seed": 1000 * (round_ + 1) + i,
                }
                for i in range(args.queue)
            ]
            files: dict[int, dict[str, p.Message]] = {}
            foreign = 0.0
            walls: dict[int, float] = {}
            for batch, worker in workers.items():
                procs = rank_processes(worker)
                wall, share, replies = timed_round(procs, lambda w=worker, b=bodies: _queue(w, b))
                walls[batch], files[batch], foreign = wall, replies, max(foreign, share)
                calls[batch].append(_calls(replies))
                print(
                    f"round {round_} max_batch={batch}: {args.queue / wall:.2f} images/s, "
                    f"{calls[batch][-1]} calls, foreign {share:.2f} cores",
                    file=sys.stderr,
                )
            psnr += [_psnr(files[4][k].blobs[0], files[1][k].blobs[0]) for k in files[4]]
            if round_ < 0:
                continue
            if foreign > args.max_foreign:
                dropped += 1
                continue
            for batch, wall in walls.items():
                rates[batch].append(args.queue / wall)
    finally:
        for worker in workers.values():
            worker.stop()
    equal = sum(v == math.inf for v in psnr)
    gain = median(rates[4]) / median(rates[1])
    print(
        f"model={args.variant} size={args.size} steps={args.steps} queue={args.queue} "
        f"rounds={args.rounds}"
    )
    print(f"rounds dropped for a noisy neighbour: {dropped}")
    print(f"pipeline calls per round: max_batch=4 {median([float(c) for c in calls[4]]):g}, "
          f"max_batch=1 {median([float(c) for c in calls[1]]):g}")  # fmt: skip
    print(f"images/s: max_batch=4 {median(rates[4]):.2f}, max_batch=1 {median(rates[1]):.2f}")
    print(
        f"batched vs alone: {equal}/{len(psnr)} images byte-identical, "
        f"least PSNR {min(psnr):.1f} dB"
    )
    print(f"batch4_tput_gain={gain:.2f}")


if __name__ == "__main__":
    main()
