"""Catch-up cost does not grow with history: a killed replica after many op pairs.

One `dpserve serve --dp-size 2` of the tiny model with a LoRA set. Replica 1 is
killed once with no history behind it, then ``--pairs`` release/resume pairs go
through the router, then replica 1 is killed again. Each time: seconds until it
serves the desired state again (``back_*``: process start, model load and warm-up
included, and serve's restart backoff, which differs between the two kills), and
of those the seconds from its new gang's first answer until it serves (``sync_*``:
the catch-up itself). ``catchup_ratio`` = back_after / back_fresh: ≈1 when a
replica's return does not depend on the number of ops ever issued (the sync times
are tens of milliseconds, too small for a steady ratio of their own). On CPU each release spills the
weights to a file, so real replicas take a few dozen ops a second: the default
history is 500 pairs (20,000 take about 25 minutes here; the router-side 20,000-pair
run is in tests/unit/test_router_control_state.py). Last line:
``pairs=<n> ops_per_s=<x> back_fresh_s=<a> back_after_s=<b> sync_fresh_s=<c>
sync_after_s=<d> catchup_ratio=<b/a>``.
"""

from __future__ import annotations

import argparse
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import cached_lora, cached_model
from dpserve.plumbing.ports import free_port


def _replicas(http: httpx.Client) -> list[dict[str, object]]:
    try:
        return list(http.get("/health/replicas").json()["replicas"])
    except (httpx.HTTPError, ValueError, KeyError):
        return []


def _kill_and_time(
    proc: subprocess.Popen[bytes], http: httpx.Client, replica: str
) -> tuple[float, float]:
    """SIGKILL the replica's supervisor and ranks. Returns the seconds until it serves
    the desired state again, and of those the seconds from its gang's first answer
    (a new boot) until then: the catch-up itself, without start-up and backoff."""
    for child in psutil.Process(proc.pid).children():
        cmd = child.cmdline()
        if "worker" in cmd and cmd[cmd.index("--replica") + 1] == replica:
            victims = [child, *child.children(recursive=True)]
            break
    else:
        raise LookupError(replica)
    started = time.monotonic()
    for victim in victims:
        victim.kill()
    seen_down, answered = False, 0.0
    while time.monotonic() - started < 600:
        state = {str(r["replica"]): r["state"] for r in _replicas(http)}.get(replica)
        now = time.monotonic()
        if state == "down":
            seen_down, answered = True, 0.0  # gone, or its new gang not up yet
        elif seen_down and not answered:
            answered = now  # the new gang's first answer: catching up from here
        if state == "serving" and answered:
            return now - started, now - answered
        time.sleep(0.02)
    raise TimeoutError("the replica did not come back")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--pairs", type=int, default=500)
    args = parser.parse_args()
    model = cached_model("tiny")
    lora = cached_lora(model)
    port = free_port()
    cmd = [sys.executable, "-m", "dpserve", "serve", "--model", str(model), "--dp-size", "2"]
    cmd += ["--port", str(port), "--scheduler-port", str(free_port())]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    http = httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=300)
    try:
        while sum(r["state"] == "serving" for r in _replicas(http)) < 2:
            time.sleep(0.5)
        body = {"lora_nickname": "fox", "lora_path": str(lora)}
        assert http.post("/v1/set_lora", json=body).status_code == 200
        fresh, fresh_sync = _kill_and_time(proc, http, "1")
        started = time.monotonic()
        for _ in range(args.pairs):
            for op in ("/release_memory_occupation", "/resume_memory_occupation"):
                r = http.post(op)
                assert r.status_code == 200, r.text
        ops_per_s = 2 * args.pairs / (time.monotonic() - started)
        after, after_sync = _kill_and_time(proc, http, "1")
        listed = http.get("/v1/list_loras").json()
        assert listed["consistent"] and len(listed["replicas"]) == 2, listed
        version = http.get("/server_info").json()["control_state"]["version"]
        print(f"control state version {version}; both replicas hold the LoRA")
    finally:
        http.close()
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=120)
    print(
        f"pairs={args.pairs} ops_per_s={ops_per_s:.0f} back_fresh_s={fresh:.2f} "
        f"back_after_s={after:.2f} sync_fresh_s={fresh_sync:.3f} sync_after_s={after_sync:.3f} "
        f"catchup_ratio={after / fresh:.2f}"
    )


if __name__ == "__main__":
    main()
