"""Realtime sessions: frame rate of a session vs plain requests, and 2 replicas vs 1.

Two replicas (one thread each) and two routers run side by side: router 1 over
replica 0 only, router 2 over both. Each round, interleaved:

- a session on router 1 streams ``frames`` frames (``frame_steps`` denoising
  steps each, from the previous frame's latents) -> session fps;
- the same number of plain generation requests with the same steps and size,
  one after the other, on router 1 -> request fps;
- two sessions on router 2, placed on different replicas, stream at once ->
  aggregate fps.

``vs_requests`` = session fps / request fps (same denoising work: above 1 means
the session path costs less per frame than a request); ``scale_2v1`` =
aggregate fps of 2 sessions on 2 replicas / fps of 1 on 1 (2 is perfect).
Rounds where other processes used more than MAX_FOREIGN cores are dropped.
Last line: ``session_fps=<x> vs_requests=<ratio> scale_2v1=<ratio>``.
"""

from __future__ import annotations

import argparse
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import cached_model, median, timed_round
from dpserve.router.sessions import session_owner
from tests.realtime_client import RealtimeSocket
from tests.servers import RouterProcess
from tests.workers import WorkerProcess

MAX_FOREIGN = 0.15


def placed(router: RouterProcess, init: dict[str, object], n: int) -> list[RealtimeSocket]:
    """``n`` sessions on ``n`` different replicas (HRW spreads them; keep those apart)."""
    socks: list[RealtimeSocket] = []
    owners: set[str] = set()
    while len(socks) < n:
        sock = RealtimeSocket(router.url, timeout_s=300)
        ack, _ = sock.init(**init, mode="step")
        owner = session_owner(ack["session_id"])
        if owner in owners:
            sock.close()
            continue
        owners.add(owner)
        socks.append(sock)
    return socks


def stream(
    router: RouterProcess, init: dict[str, object], n: int, frames: int, pool: ThreadPoolExecutor
) -> float:
    """``n`` sessions on ``n`` replicas stream ``frames`` frames each, at once; wall time.

    The sessions are placed first and then resumed in stream mode; the clock runs
    from the first resume's ack to the last frame, so it covers streaming only (not
    placement, nor the first frame, which is a full generation).
    """
    placing = placed(router, init, n)
    ids = [s.session_id for s in placing]

    def one(session_id: str | None) -> tuple[float, float]:
        assert session_id is not None
        with RealtimeSocket(router.url, timeout_s=300) as sock:
            sock.resume(session_id, mode="stream", max_frames=frames)
            start = time.perf_counter()
            got = sock.frames(frames)
            end = time.perf_counter()
            sock.expect("done")  # and the session is released
        assert [f["index"] for f in got] == list(range(1, frames + 1))
        return start, end

    try:
        spans = list(pool.map(one, ids))
        return max(e for _, e in spans) - min(s for s, _ in spans)
    finally:
        for sock in placing:
            sock.close()  # taken over: closing them releases nothing


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--variant", default="small", choices=("tiny", "small"))
    parser.add_argument("--size", type=int, default=128)
    parser.add_argument("--frame-steps", type=int, default=2)
    parser.add_argument("--frames", type=int, default=12)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    model = cached_model(args.variant)
    size = f"{args.size}x{args.size}"
    extra = ["--threads-per-rank", "1", "--max-sequence-length", "77"]
    init = {
        "prompt": "a harbour at dawn",
        "size": size,
        "num_inference_steps": 4,
        "frame_steps": args.frame_steps,
        "seed": 7,
    }
    request = {
        "prompt": "a harbour at dawn",
        "size": size,
        "num_inference_steps": args.frame_steps,
        "seed": 7,
    }
    workers = [WorkerProcess(model, "--replica", str(r), *extra) for r in range(2)]
    routers = [RouterProcess([workers[0].endpoint]), RouterProcess([w.endpoint for w in workers])]
    pids = [w.proc.pid for w in workers] + [r.proc.pid for r in routers]
    procs = [psutil.Process(pid) for pid in pids]
    procs += [c for p in list(procs) for c in p.children(recursive=True)]
    one, plain, pair = [], [], []
    dropped = 0
    try:
        with ThreadPoolExecutor(2) as pool:
            stream(routers[0], init, 1, 2, pool)  # warm both paths once
            routers[0].http.post("/v1/images/generations", json=request).raise_for_status()
            for _ in range(args.rounds):
                # The streams' own clocks (resume ack to last frame); the rounds'
                # wall times also cover placement and only serve the noise check.
                _, f1, t_one = timed_round(
                    procs, lambda: stream(routers[0], init, 1, args.frames, pool)
                )
                t_plain, f2, _ = timed_round(
                    procs,
                    lambda: [
                        routers[0].http.post("/v1/images/generations", json=request)
                        for _ in range(args.frames)
                    ],
                )
                _, f3, t_pair = timed_round(
                    procs, lambda: stream(routers[1], init, 2, args.frames, pool)
                )
                print(
                    f"session={t_one:.2f}s requests={t_plain:.2f}s pair={t_pair:.2f}s "
                    f"foreign={max(f1, f2, f3):.2f}",
                    file=sys.stderr,
                )
                if max(f1, f2, f3) > MAX_FOREIGN:
                    dropped += 1
                    continue
                one.append(args.frames / t_one)
                plain.append(args.frames / t_plain)
                pair.append(2 * args.frames / t_pair)
    finally:
        for router in routers:
            router.close()
        for worker in workers:
            worker.stop()
    fps, req_fps, pair_fps = median(one), median(plain), median(pair)
    print(
        f"model={args.variant} size={size} frame_steps={args.frame_steps} "
        f"frames={args.frames} rounds={args.rounds}"
    )
    print(f"rounds dropped for a noisy neighbour: {dropped}")
    print(f"request_fps={req_fps:.2f} pair_fps={pair_fps:.2f}")
    print(f"session_fps={fps:.2f} vs_requests={fps / req_fps:.2f} scale_2v1={pair_fps / fps:.2f}")


if __name__ == "__main__":
    main()
