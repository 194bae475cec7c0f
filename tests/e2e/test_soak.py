"""A short soak (bench/soak.py): 200 clients for 8 s through a real router over stub drivers.

No errors, no descriptor left open, and the router's books balance. RSS is not
judged here: 8 s of a Python process warming its allocator say little about
a leak; the 5-minute soak reports it.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[2]


def test_short_soak_has_no_errors_and_leaves_nothing_open() -> None:
    cmd = [sys.executable, str(ROOT / "bench" / "soak.py"), "--clients", "200"]
    cmd += ["--duration", "8", "--warmup", "2", "--samples", "3"]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stdout + done.stderr
    lines = done.stdout.strip().splitlines()
    figures = dict(kv.split("=", 1) for kv in lines[-1].split()[1:])
    assert int(figures["errors"]) == 0, done.stdout
    assert int(figures["requests"]) > 0
    assert figures["accepted"] == figures["answered"], done.stdout
    # Under the same load, the same connections; idle, the same descriptors as before.
    assert abs(int(figures["fds_end"]) - int(figures["fds_start"])) <= 10, done.stdout
    assert int(figures["fds_idle_after"]) <= int(figures["fds_idle_before"]) + 2, done.stdout
