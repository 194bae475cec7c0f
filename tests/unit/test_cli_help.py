"""`dpserve --version` and `--help` with defaults, as a user runs them."""

from __future__ import annotations

import re
import subprocess
import sys
from importlib.metadata import version

import pytest


def _dpserve(*args: str) -> str:
    done = subprocess.run(
        [sys.executable, "-m", "dpserve", *args], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_version_is_the_installed_distributions() -> None:
    assert _dpserve("--version") == f"dpserve {version('dpserve')}\n"


def _help(command: str) -> str:
    return " ".join(_dpserve(command, "--help").split())  # argparse wraps lines anywhere


@pytest.mark.parametrize(
    ("command", "shown"),
    [
        ("serve", ["--port PORT HTTP port (default: 8000)", "(default: 5575)", "(default: 1)"]),
        ("router", ["--policy {round_robin,least_work}", "(default: least_work)"]),
        # The worker's flags come from WorkerConfig's Flag metadata, defaults included.
        ("worker", ["--max-queue MAX_QUEUE queued requests per replica (default: 64)"]),
        ("make-tiny-model", ["(default: tiny)"]),
    ],
)
def test_help_shows_defaults_worth_showing(command: str, shown: list[str]) -> None:
    text = _help(command)
    for words in shown:
        assert words in text
    # Nothing to say is said: no None, no empty list, no "off" for a switch.
    assert not re.search(r"\(default: (None|\[\]|\(\)|False)\)", text)
