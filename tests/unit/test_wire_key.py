"""The service's wire key file: what it holds, how it is written, what a bad one says."""

from __future__ import annotations

import stat
from pathlib import Path

import pytest
import zmq

from dpserve.plumbing.curve import WireKey, WireKeyError


def test_a_written_key_loads_back_and_only_its_owner_reads_it(tmp_path: Path) -> None:
    key = WireKey.generate()
    path = tmp_path / "wire.key"
    path.write_text("stale")
    path.chmod(0o644)
    key.write(path)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert path.read_bytes().strip() == key.secret
    assert WireKey.load(path) == key
    assert key.public == zmq.curve_public(key.secret)


def test_surrounding_whitespace_is_ignored(tmp_path: Path) -> None:
    key = WireKey.generate()
    path = tmp_path / "wire.key"
    path.write_bytes(b"\n  " + key.secret + b"\r\n\n")
    assert WireKey.load(path) == key


@pytest.mark.parametrize(
    ("content", "says"),
    [
        (b"", "40 z85 characters"),
        (b"short", "40 z85 characters"),
        (b"~" * 40, "not a z85"),  # right length, not z85
    ],
)
def test_a_bad_key_file_says_what_to_fix(tmp_path: Path, content: bytes, says: str) -> None:
    path = tmp_path / "wire.key"
    path.write_bytes(content)
    with pytest.raises(WireKeyError, match=says) as caught:
        WireKey.load(path)
    assert str(path) in str(caught.value) and "curve_keypair" in str(caught.value)


def test_a_missing_key_file_names_it(tmp_path: Path) -> None:
    with pytest.raises(WireKeyError, match=r"cannot read wire key file .*nope"):
        WireKey.load(tmp_path / "nope")


@pytest.mark.parametrize(
    "argv",
    [
        ["router", "--worker", "tcp://127.0.0.1:1"],
        ["probe", "--port", "1"],
    ],
)
def test_a_bad_key_file_stops_the_command_with_what_to_fix(
    tmp_path: Path, argv: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    from dpserve.cli import main

    bad = tmp_path / "wire.key"
    bad.write_text("short")
    assert main([*argv, "--wire-key-file", str(bad)]) == 2
    assert f"wire key file {bad}" in capsys.readouterr().err


def test_the_worker_flag_round_trips() -> None:
    from dpserve.config.worker import WorkerConfig

    config = WorkerConfig(model=Path("/m"), port=5000, wire_key_file=Path("/k/wire.key"))
    assert "--wire-key-file" in config.to_args()
    assert config.to_args()[config.to_args().index("--wire-key-file") + 1] == "/k/wire.key"


def test_a_key_never_shows_its_secret_in_a_repr() -> None:
    key = WireKey.generate()
    assert key.secret.decode() not in repr(key) and key.public.decode() in repr(key)
