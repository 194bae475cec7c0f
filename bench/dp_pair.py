"""The seed's measurement: a concurrent pair vs one request, --dp-size 2 and 1, one run.

Two `dpserve serve` instances (dp=2 and dp=1) run side by side; rounds alternate
between them. ``pair_ratio`` is the wall time of two concurrent requests divided
by one request's: ≈1 when the pair really runs in parallel, ≈2 when it
serializes. Rounds where other processes used more than MAX_FOREIGN cores are
discarded. Last line: ``pair_ratio_dp2=<x> pair_ratio_dp1=<y>``.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import cached_model, median, timed_round
from dpserve.plumbing.ports import free_port

MAX_FOREIGN = 0.15


class Serve:
    def __init__(self, model: Path, dp: int, extra: list[str]) -> None:
        self.url = f"http://127.0.0.1:{free_port()}"
        port = self.url.rsplit(":", 1)[1]
        cmd = [sys.executable, "-m", "dpserve", "serve", "--model", str(model), "--port", port]
        cmd += ["--dp-size", str(dp), "--scheduler-port", str(free_port()), *extra]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        self.http = httpx.Client(base_url=self.url, timeout=300)
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            try:
                if self.http.get("/health").status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.5)
        raise TimeoutError(f"serve dp={dp} did not come up")

    def processes(self) -> list[psutil.Process]:
        root = psutil.Process(self.proc.pid)
        return [root, *root.children(recursive=True)]

    def post(self, body: dict[str, object]) -> None:
        response = self.http.post("/v1/images/generations", json=body)
        response.raise_for_status()

    def close(self) -> None:
        self.proc.terminate()
        self.proc.wait(timeout=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--variant", default="small", choices=("tiny", "small"))
    parser.add_argument("--size", type=int, default=128)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--rounds", type=int, default=6)
    args = parser.parse_args()
    model = cached_model(args.variant)
    extra = ["--threads-per-rank", "1", "--max-sequence-length", "77"]
    body = {
        "prompt": "a harbour at dawn",
        "size": f"{args.size}x{args.size}",
        "num_inference_steps": args.steps,
        "seed": 7,
    }
    serves = {2: Serve(model, 2, extra), 1: Serve(model, 1, extra)}
    ratios: dict[int, list[float]] = {1: [], 2: []}
    dropped = 0
    try:
        with ThreadPoolExecutor(2) as pool:
            for serve in serves.values():
                serve.post(body)  # warm the HTTP path and every replica once
                serve.post(body)
            for _ in range(args.rounds):
                for dp, serve in serves.items():
                    procs = serve.processes()
                    single, f1, _ = timed_round(procs, lambda s=serve: s.post(body))
                    pair, f2, _ = timed_round(
                        procs, lambda s=serve: list(pool.map(lambda _: s.post(body), range(2)))
                    )
                    print(f"dp={dp} single={single:.3f}s pair={pair:.3f}s", file=sys.stderr)
                    if max(f1, f2) > MAX_FOREIGN:
                        dropped += 1
                        continue
                    ratios[dp].append(pair / single)
    finally:
        for serve in serves.values():
            serve.close()
    print(f"model={args.variant} size={args.size} steps={args.steps} rounds={args.rounds}")
    print(f"rounds dropped for a noisy neighbour: {dropped}")
    print(f"pair_ratio_dp2={median(ratios[2]):.2f} pair_ratio_dp1={median(ratios[1]):.2f}")


if __name__ == "__main__":
    main()
