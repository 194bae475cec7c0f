"""--compile: compiled vs eager latency after warm-up, and what the first request pays.

Two replicas run side by side, one eager and one with ``--compile --compile-size
SxS`` (its warm-up compiles that size before it serves), and requests alternate
between them. ``compile_speedup`` is the eager median over the compiled median
(the replicas' own inference times); ``first_request_ratio`` is the compiled
replica's first request at the warmed size over its steady median (about 1: the
warm-up paid for the compilation). Last line:
``compile_speedup=<x> first_request_ratio=<y>``.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import add_model_args, median, model_and_flags, one_request
from dpserve.local import WorkerProcess


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    add_model_args(parser, steps=8, rounds=5)
    parser.add_argument("--ready-timeout", type=float, default=900.0, help="compile is slow")
    args = parser.parse_args()

    model, flags = model_and_flags(args)
    request = one_request(args.size, args.steps)
    compiling = ["--compile", "--compile-size", f"{args.size}x{args.size}"]
    started = time.perf_counter()
    with (
        WorkerProcess(model, *flags, *compiling, ready_timeout_s=args.ready_timeout) as fast,
        fast.client(timeout_s=600) as compiled,
    ):
        ready_s = time.perf_counter() - started
        first = compiled.generate(**request)[0].inference_time_s
        with WorkerProcess(model, *flags) as plain, plain.client(timeout_s=600) as eager:
            eager.generate(**request)  # first-request effects out of the timed rounds
            times: dict[str, list[float]] = {"compiled": [], "eager": []}
            for _ in range(args.rounds):
                times["compiled"].append(compiled.generate(**request)[0].inference_time_s)
                times["eager"].append(eager.generate(**request)[0].inference_time_s)
    steady, base = median(times["compiled"]), median(times["eager"])
    print(f"compiled replica ready in {ready_s:.1f}s (load, compile, warm-up)")
    print(f"first request {first:.3f}s, then {steady:.3f}s compiled vs {base:.3f}s eager")
    print(f"(model {model.name}, {args.size}px, {args.steps} steps, {args.rounds} rounds)")
    print(f"compile_speedup={base / steady:.2f} first_request_ratio={first / steady:.2f}")


if __name__ == "__main__":
    main()
