"""Start-up as a user meets it: a taken port fails at once, naming the port; the
phases of a replica's start are logged with their times; the banner's calls fit
the model and work as printed."""

from __future__ import annotations

import json
import re
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest

from tests.polling import eventually
from tests.workers import free_port

pytestmark = pytest.mark.e2e

DPSERVE = [sys.executable, "-m", "dpserve"]
# The command's own start (an interpreter, the CLI's imports) on a busy 2-core machine;
# a replica's start takes a minute there, so a check after it could not pass this.
FAST_S = 15.0


@contextmanager
def _squatter() -> Iterator[int]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", free_port()))
        s.listen()
        yield int(s.getsockname()[1])


def _timed(cmd: list[str]) -> tuple[int, str, float]:
    started = time.monotonic()
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    return done.returncode, done.stdout + done.stderr, time.monotonic() - started


def test_a_taken_port_stops_each_command_before_anything_slow(tiny_model: Path) -> None:
    with _squatter() as port:
        serve = [*DPSERVE, "serve", "--model", str(tiny_model), "--dp-size", "2"]
        serve += ["--port", str(port), "--scheduler-port", str(free_port())]
        worker = [*DPSERVE, "worker", "--model", str(tiny_model), "--port", str(port)]
        router = [*DPSERVE, "router", "--worker", "tcp://127.0.0.1:1", "--port", str(port)]
        for cmd in (serve, worker, router):
            code, output, took = _timed(cmd)
            assert code == 2, output
            assert f"dpserve {cmd[3]}: port {port} is taken (127.0.0.1:{port})" in output
            assert "pick another --port" in output
            assert took < FAST_S, f"{cmd[3]} took {took:.1f}s"
            # Nothing started: no replica, no rank, no router.
            assert not re.search(r"starting|started|importing|Uvicorn", output), output


class Serve:
    """`dpserve serve` with its stdout (the banner) read line by line, stderr to a file."""

    def __init__(self, model: Path, dp_size: int, log: Path) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [*DPSERVE, "serve", "--model", str(model), "--dp-size", str(dp_size)]
        cmd += ["--port", str(self.port), "--scheduler-port", str(free_port())]
        self.log = log
        with log.open("wb") as err:
            self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=err, text=True)
        self.lines: list[str] = []
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line.rstrip("\n"))

    def banner(self, timeout_s: float = 400) -> list[str]:
        def shown() -> bool:
            assert self.proc.poll() is None, f"serve exited: {self.log.read_text()[-3000:]}"
            return any("Ctrl-C stops everything." in line for line in self.lines)

        eventually(shown, timeout_s, "the banner")
        first = next(i for i, line in enumerate(self.lines) if line.startswith("dpserve ready"))
        return self.lines[first:]

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait()


def _commands(banner: list[str]) -> list[str]:
    """The banner's curl commands, continuation lines joined."""
    out: list[str] = []
    joined = ""
    for line in banner:
        text = line.strip()
        if not (joined or text.startswith("curl ")):
            continue
        joined += text.removesuffix("\\")
        if not text.endswith("\\"):
            out.append(joined)
            joined = ""
    return out


def _sh(command: str, cwd: Path) -> str:
    done = subprocess.run(["sh", "-c", command], capture_output=True, text=True, cwd=cwd)
    assert done.returncode == 0, (command, done.stderr)
    return done.stdout


PHASES = (
    "importing torch, diffusers and transformers",
    "imported torch ",
    "loading ",
    "loaded FluxPipeline in ",
    "warming up at 64x64",
    " INFO start-up ",
)


def _phases(log: str, replica: int) -> list[str]:
    mine = [line for line in log.splitlines() if f"replica{replica}/rank0 " in line]
    return [next(line for line in mine if phase in line) for phase in PHASES]


def test_serve_logs_its_phases_and_its_banner_calls_answer(
    tiny_model: Path, tmp_path: Path
) -> None:
    serve = Serve(tiny_model, 2, tmp_path / "stderr")
    try:
        banner = serve.banner()
        generate, health = _commands(banner)
        assert "/v1/images/generations" in generate and "/health/replicas" in health
        image = _sh(generate, tmp_path)  # as printed: the answer's first 300 bytes
        assert image.startswith('{"id":"img-') and '"b64_json":"iVBOR' in image
        assert len(json.loads(_sh(health, tmp_path))["replicas"]) == 2
        with httpx.Client(base_url=serve.url, timeout=60) as http:  # /docs over real HTTP
            assert http.get("/docs").status_code == 200
            js = http.get("/docs/assets/swagger-ui-bundle.js")
            assert js.status_code == 200 and js.headers["content-type"].startswith(
                "text/javascript"
            )
        assert serve.stop() == 0
    finally:
        serve.stop()
    log = serve.log.read_text()
    for replica in (0, 1):
        lines = _phases(log, replica)
        times = [line.split(" INFO ")[0][:23] for line in lines]
        assert times == sorted(times), lines  # in this order, each after the last
        summary = lines[-1]
        assert re.search(
            r"imports \d+\.\ds, gang \d+\.\ds, load \d+\.\ds, warm-up \d+\.\ds", summary
        )
        print(f"replica {replica}: {summary.split(' INFO ')[1]}")  # the figures (pytest -s)
    assert re.search(r"dpserve ready in \d+\.\ds: 2 replica\(s\)", banner[0])
    assert "torchvision" not in log


@pytest.mark.parametrize("fixture", ["tiny_video_model", "tiny_i2v_model"])
def test_a_video_models_banner_shows_video_calls_that_work(
    fixture: str, request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    serve = Serve(request.getfixturevalue(fixture), 1, tmp_path / "stderr")
    try:
        banner = serve.banner()
        assert not any("/v1/images" in line or "realtime" in line for line in banner)
        submit, status, content, health = _commands(banner)
        if fixture == "tiny_i2v_model":  # the one word the user fills in: their image
            from PIL import Image

            Image.new("RGB", (80, 60), (30, 90, 200)).save(tmp_path / "YOUR_IMAGE.png")
            assert "input_reference=@YOUR_IMAGE.png" in submit
        job = json.loads(_sh(submit, tmp_path))
        assert (job.get("object"), job.get("size")) == ("video", "64x48"), job
        poll = status.replace("VIDEO_ID", shlex.quote(job["id"]))

        def completed() -> bool:
            state = json.loads(_sh(poll, tmp_path))["status"]
            assert state in ("queued", "in_progress", "completed"), state
            return state == "completed"

        eventually(completed, 120, "the banner's video job")
        _sh(content.replace("VIDEO_ID", shlex.quote(job["id"])), tmp_path)
        assert (tmp_path / "video.mp4").read_bytes()[4:8] == b"ftyp"  # an mp4
        assert len(json.loads(_sh(health, tmp_path))["replicas"]) == 1
    finally:
        serve.stop()
