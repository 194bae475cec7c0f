"""Step caches: speed-up and quality of each offered cache against the uncached image.

One replica; the same request (fixed seed) runs uncached and with each cache, in
alternating rounds so drift on the machine hits all alike. Speed-up is the median
uncached inference time over the cached one (the replica's own timing, without
encoding); quality is the PSNR of the cached PNG against the uncached one (same
seed). On random weights (the tiny models) the first block's residual changes by
~60 % a step, so Flux's usual first-block-cache thresholds (0.05-0.1) skip nothing:
the default threshold here is one that does skip on them. Last line:
``fbc_speedup=<x> fbc_psnr_db=<y> taylorseer_speedup=<x> taylorseer_psnr_db=<y>``.
"""

from __future__ import annotations

import argparse
import io
import sys
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import add_model_args, median, model_and_flags, one_request
from dpserve.local import WorkerProcess


def psnr_db(a: bytes, b: bytes) -> float:
    x, y = (np.asarray(Image.open(io.BytesIO(i)), dtype=np.float64) / 255 for i in (a, b))
    mse = float(((x - y) ** 2).mean())
    return float("inf") if mse == 0 else float(10 * np.log10(1 / mse))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    add_model_args(parser, steps=20, rounds=3)
    parser.add_argument("--fbc-threshold", type=float, default=0.6)
    parser.add_argument("--taylorseer-interval", type=int, default=3)
    args = parser.parse_args()

    model, flags = model_and_flags(args)
    caches: dict[str, Any] = {
        "uncached": "none",
        "fbc": {"type": "first_block_cache", "threshold": args.fbc_threshold},
        "taylorseer": {"type": "taylorseer", "interval": args.taylorseer_interval},
    }
    request = one_request(args.size, args.steps)
    times: dict[str, list[float]] = {name: [] for name in caches}
    pngs: dict[str, bytes] = {}
    with WorkerProcess(model, *flags) as worker, worker.client(timeout_s=600) as client:
        client.generate(**request)  # first-request effects out of the timed rounds
        for _ in range(args.rounds):
            for name, cache in caches.items():
                result, (png,) = client.generate(**request, step_cache=cache)
                times[name].append(result.inference_time_s)
                pngs[name] = png
    base = median(times["uncached"])
    figures = []
    for name in ("fbc", "taylorseer"):
        seconds, quality = median(times[name]), psnr_db(pngs[name], pngs["uncached"])
        print(f"{name}: {seconds:.3f}s vs {base:.3f}s uncached, PSNR {quality:.1f} dB")
        figures += [f"{name}_speedup={base / seconds:.2f}", f"{name}_psnr_db={quality:.1f}"]
    print(f"(model {model.name}, {args.size}px, {args.steps} steps, {args.rounds} rounds)")
    print(" ".join(figures))


if __name__ == "__main__":
    main()
