"""Faults under steady load: a stopped driver, a stopped non-driver rank, a killed replica.

One `dpserve serve --dp-size 2 --cfg 2` (each replica a gang of two ranks) with a
LoRA set, and a few clients generating without pause. In turn:

1. SIGSTOP replica 0's driver: its in-flight requests must be answered by replica 1
   within the ping deadline. ``stopped_driver_retry_s`` is the longest a request
   in flight at the stop waited beyond a normal request. SIGCONT after 7 s (within
   the supervisor's hang timeout, past which the gang is restarted): it rejoins.
2. SIGSTOP replica 1's non-driver rank (idle and busy alike to the gang, which
   only the gang can notice): ``stopped_rank_detect_s`` is the time until the
   router takes it out of rotation; serve's supervisor restarts it, and the
   router brings it to the desired control state.
3. SIGKILL replica 0 (supervisor and ranks): restarted by serve.

After each, every replica serves again with the LoRA active. Last line:
``stopped_driver_retry_s=<x> stopped_rank_detect_s=<y> failed=<n> accepted=<a> answered=<b>``
(accepted and answered: every HTTP request the router took, from its /metrics).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import cached_lora, cached_model
from dpserve.plumbing.ports import free_port
from dpserve.router.metrics import read_accounting
from tests.workers import gang_ranks

REQUEST = {"prompt": "a red fox", "size": "64x64", "num_inference_steps": 4}
ROUTE = "/v1/images/generations"


@dataclass
class Load:
    """Clients that generate without pause; each request's start, end and outcome."""

    url: str
    clients: int
    stop: threading.Event = field(default_factory=threading.Event)
    done: list[tuple[float, float, int, str]] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def run(self) -> list[threading.Thread]:
        threads = [threading.Thread(target=self._client, daemon=True) for _ in range(self.clients)]
        for t in threads:
            t.start()
        return threads

    def _client(self) -> None:
        with httpx.Client(base_url=self.url, timeout=600) as http:
            while not self.stop.is_set():
                start = time.monotonic()
                try:
                    r = http.post(ROUTE, json=REQUEST)
                    status, replica = r.status_code, r.headers.get("X-Dpserve-Replica", r.text)
                except httpx.HTTPError as exc:
                    status, replica = 0, str(exc)
                with self.lock:
                    self.done.append((start, time.monotonic(), status, replica))

    def failures(self) -> list[tuple[float, float, int, str]]:
        with self.lock:
            return [d for d in self.done if d[2] != 200]

    def spanning(self, moment: float) -> list[float]:
        """Latencies of the requests in flight at ``moment``."""
        with self.lock:
            return [end - start for start, end, _, _ in self.done if start <= moment <= end]

    def typical(self) -> float:
        with self.lock:
            lat = sorted(end - start for start, end, status, _ in self.done if status == 200)
        return lat[len(lat) // 2] if lat else 0.0


class Serve:
    def __init__(self, model: Path, lora: Path) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [sys.executable, "-m", "dpserve", "serve", "--model", str(model), "--dp-size", "2"]
        cmd += ["--cfg", "2", "--port", str(self.port), "--scheduler-port", str(free_port())]
        cmd += ["--allow-path", str(lora.parent)]  # set_lora loads only from allowed folders
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        self.http = httpx.Client(base_url=self.url, timeout=300)
        self.wait(lambda: self.serving() == 2, 600)
        body = {"lora_nickname": "fox", "lora_path": str(lora)}
        assert self.http.post("/v1/set_lora", json=body).status_code == 200

    def replicas(self) -> list[dict[str, object]]:
        try:
            return list(self.http.get("/health/replicas").json()["replicas"])
        except (httpx.HTTPError, ValueError, KeyError):
            return []

    def serving(self) -> int:
        return sum(r["state"] == "serving" for r in self.replicas())

    def wait(self, check: object, timeout_s: float) -> float:
        started = time.monotonic()
        while not check():  # type: ignore[operator]
            if time.monotonic() - started > timeout_s:
                raise TimeoutError("the service did not recover in time")
            time.sleep(0.1)
        return time.monotonic() - started

    def supervisor(self, replica: int) -> psutil.Process:
        for child in psutil.Process(self.proc.pid).children():
            cmd = child.cmdline()
            if "worker" in cmd and cmd[cmd.index("--replica") + 1] == str(replica):
                return child
        raise LookupError(replica)

    def ranks(self, replica: int) -> list[psutil.Process]:
        return gang_ranks(self.supervisor(replica))

    def lora_everywhere(self) -> bool:
        listed = self.http.get("/v1/list_loras").json()
        return bool(listed.get("consistent")) and len(listed.get("replicas", [])) == 2

    def close(self) -> None:
        self.http.close()
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def _state(serve: Serve, replica: str) -> str:
    return next((str(r["state"]) for r in serve.replicas() if r["replica"] == replica), "gone")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--clients", type=int, default=3)
    parser.add_argument("--settle-s", type=float, default=8.0)
    args = parser.parse_args()
    model = cached_model("tiny")
    lora = cached_lora(model)
    serve = Serve(model, lora)
    load = Load(serve.url, args.clients)
    threads = load.run()
    try:
        time.sleep(args.settle_s)
        typical = load.typical()

        driver = serve.ranks(0)[0]
        stopped_at = time.monotonic()
        os.kill(driver.pid, signal.SIGSTOP)
        time.sleep(7)  # under the supervisor's 10 s hang timeout: it comes back on its own
        os.kill(driver.pid, signal.SIGCONT)
        serve.wait(lambda: serve.serving() == 2, 120)
        in_flight = load.spanning(stopped_at)
        retry_s = max((lat - typical for lat in in_flight), default=0.0)
        print(f"stopped driver: {len(in_flight)} in flight, worst extra wait {retry_s:.2f}s")

        rank = serve.ranks(1)[1]
        os.kill(rank.pid, signal.SIGSTOP)
        detect_s = serve.wait(lambda: _state(serve, "1") != "serving", 120)
        back_s = serve.wait(lambda: serve.serving() == 2 and serve.lora_everywhere(), 600)
        print(
            f"stopped rank: out of rotation in {detect_s:.2f}s, serving again {back_s:.1f}s later"
        )
        with contextlib.suppress(ProcessLookupError, psutil.Error):
            os.kill(rank.pid, signal.SIGCONT)  # already killed by its supervisor, usually

        time.sleep(args.settle_s)
        victim = serve.supervisor(0)
        for proc in [victim, *victim.children(recursive=True)]:
            with contextlib.suppress(ProcessLookupError, psutil.Error):
                proc.kill()
        killed_s = serve.wait(lambda: serve.serving() == 2 and serve.lora_everywhere(), 600)
        print(f"killed replica: serving again in {killed_s:.1f}s")
        time.sleep(args.settle_s)
    finally:
        load.stop.set()
        for t in threads:
            t.join(timeout=600)
    books = read_accounting(serve.http.get("/metrics").text)
    serve.close()
    failed = len(load.failures())
    for start, end, status, text in load.failures()[:5]:
        print(f"failed: {status} after {end - start:.1f}s: {text[:200]}")
    answered = sum(books.answered.values())
    print(
        f"stopped_driver_retry_s={retry_s:.2f} stopped_rank_detect_s={detect_s:.2f} "
        f"failed={failed} accepted={books.accepted} answered={answered}"
    )


if __name__ == "__main__":
    main()
