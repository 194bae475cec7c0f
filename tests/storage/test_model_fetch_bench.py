"""A short run of bench/model_fetch.py (its throughput and replicas sections on the tiny
model), so the bench keeps running and its replicas figure keeps meaning one fetch."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.e2e, pytest.mark.s3]

ROOT = Path(__file__).resolve().parents[2]


def test_the_bench_fetches_one_model_for_two_replicas(tiny_model: Path) -> None:
    cmd = [sys.executable, str(ROOT / "bench" / "model_fetch.py"), "--model", str(tiny_model)]
    cmd += ["--sections", "throughput,replicas", "--replicas", "2"]
    cmd += ["--shards", "1", "--shard-mb", "9", "--rounds", "1"]  # 9 MB: a multipart upload
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    figures = dict(kv.split("=", 1) for kv in done.stdout.strip().splitlines()[-1].split())
    assert sorted(figures) == ["fetch_ratio", "replicas2_bytes_ratio", "vs_checked_ratio"]
    assert float(figures["fetch_ratio"]) > 0 and float(figures["vs_checked_ratio"]) > 0
    # The tiny model is 4.8 MB; requests' overhead is a few kB: one fetch reads 1.00.
    assert float(figures["replicas2_bytes_ratio"]) == pytest.approx(1.0, abs=0.02)
