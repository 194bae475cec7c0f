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

from bench.common import cached_model, median
from dpserve.local import WorkerProcess


def psnr_db(a: bytes, b: bytes) -> float:
    x, y = (np.asarray(Image.open(io.BytesIO(i)), dtype=np.float64) / 255 for i in (a, b))
    mse = float(((x - y) ** 2).mean())
    return float("inf") if mse == 0 else float(10 * np.log10(1 / mse))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", type=Path, help="a model folder (default: --variant's)")
    parser.add_argument("--variant", default="small", choices=("tiny", "small"))
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--size", type=int, default=128)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--fbc-threshold", type=float, default=0.6)
    parser.add_argument("--taylorseer-interval", type=int, default=3)
    parser.add_argument("--max-sequence-length", type=int, default=77)
    args = parser.parse_args()

    model = args.model or cached_model(args.variant)
    caches: dict[str, Any] = {
        "uncached": "none",
        "fbc": {"type": "first_block_cache", "threshold": args.fbc_threshold},
        "taylorseer": {"type": "taylorseer", "interval": args.taylorseer_interval},
    }
    request = {
        "prompt": "a watercolor lighthouse at dusk",
        "width": args.size,
        "height": args.size,
        "num_inference_steps": args.steps,
        "seed": 1234,
    }
    flags = ["--device", args.device, "--dtype", args.dtype]
    flags += ["--max-sequence-length", str(args.max_sequence_length)]
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
