"""`make setup` and `make serve` as a user runs them: the package's metadata builds
without setuptools' warnings, and `make serve` passes ARGS on."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import setuptools
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[2]


def test_metadata_builds_with_an_spdx_license_and_no_warning(tmp_path: Path) -> None:
    # The SPDX form needs setuptools 77: the build asks for it.
    assert 'requires = ["setuptools>=77"]' in (ROOT / "pyproject.toml").read_text()
    if Version(setuptools.__version__) < Version("77"):
        pytest.skip("the build requires setuptools 77 (pip's isolated build fetches it)")
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, tmp_path / name)
    (tmp_path / "out").mkdir()
    build = "from setuptools import build_meta as b; b.prepare_metadata_for_build_wheel('out')"
    done = subprocess.run(
        [sys.executable, "-W", "always", "-c", build],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert "Warning" not in done.stderr, done.stderr  # setuptools' deprecation walls
    (metadata,) = (tmp_path / "out").glob("*.dist-info/METADATA")
    assert "License-Expression: Apache-2.0" in metadata.read_text().splitlines()


@pytest.mark.skipif(shutil.which("make") is None, reason="no make")
def test_make_serve_passes_args_on(tmp_path: Path) -> None:
    venv = tmp_path / "venv"  # absent: make -n prints the set-up, then the command
    done = subprocess.run(
        ["make", "-n", "serve", f"VENV={venv}", "ARGS=--port 9000 --api-key-file keys"],
        cwd=ROOT,
        # Under `make test` a nested make would print "Entering/Leaving directory".
        env={k: v for k, v in os.environ.items() if k not in ("MAKEFLAGS", "MAKELEVEL", "MFLAGS")},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    last = done.stdout.strip().splitlines()[-1]
    assert last == f"{venv}/bin/dpserve serve --dp-size 2 --port 9000 --api-key-file keys"
