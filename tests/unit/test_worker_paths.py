"""The allowed-folder policy of control ops, on real folders and symlinks: every way out
of the roots is refused with the same words, so a refusal says nothing about what exists."""

from __future__ import annotations

from pathlib import Path

import pytest

from dpserve.contract.protocol import (
    RequestError,
)
from dpserve.worker.paths import REFUSED, AllowedPaths, pickle_problem


@pytest.fixture()
def tree(tmp_path: Path) -> Path:
    """model/ and loras/ (allowed), secret/ beside them (not), and symlinks both ways."""
    for folder in ("model/transformer", "loras/style", "secret/weights"):
        (tmp_path / folder).mkdir(parents=True)
    (tmp_path / "loras/file.safetensors").write_bytes(b"x")
    (tmp_path / "loras/out").symlink_to(tmp_path / "secret")  # leaves the root
    (tmp_path / "secret/in").symlink_to(tmp_path / "loras/style")  # comes back in
    (tmp_path / "loras/loop").symlink_to(tmp_path / "loras/loop")
    return tmp_path


def _refusal(allowed: AllowedPaths, raw: str) -> str:
    with pytest.raises(RequestError) as err:
        allowed.folder(raw, "lora_path")
    assert err.value.code == "invalid_request" and err.value.fields[0].field == "lora_path"
    return str(err.value)


def test_folders_under_a_root_resolve_to_their_real_path(tree: Path) -> None:
    allowed = AllowedPaths.of(tree / "model", [tree / "loras"])
    assert allowed.folder(str(tree / "loras/style"), "x") == tree / "loras/style"
    assert allowed.folder(str(tree / "loras"), "x") == tree / "loras"  # the root itself
    assert allowed.folder(str(tree / "model/transformer/.."), "x") == tree / "model"
    # A symlink from outside that lands inside a root is judged by where it lands.
    assert allowed.folder(str(tree / "secret/in"), "x") == tree / "loras/style"
    assert allowed.folder(str(tree / "loras/style") + "/", "x") == tree / "loras/style"


def test_every_way_out_gets_one_identical_message(tree: Path) -> None:
    allowed = AllowedPaths.of(tree / "model", [tree / "loras"])
    attempts = [
        str(tree / "secret"),  # an absolute path elsewhere that exists
        str(tree / "secret/weights"),
        str(tree / "nowhere"),  # one that does not exist
        str(tree / "loras/nowhere"),  # nor under a root
        str(tree / "loras/../secret"),  # .. out of a root
        str(tree / "loras/out"),  # a symlink out of a root
        str(tree / "loras/out/weights"),
        str(tree / "loras/file.safetensors"),  # a file, not a folder
        str(tree / "loras/loop"),  # a symlink loop
        "loras/style",  # relative: whose cwd?
        "",
        "/",
        str(tree / "loras") + "\x00/x",
        str(tree / "loras-evil"),  # a sibling sharing the root's name as a prefix
    ]
    (tree / "loras-evil").mkdir()
    messages = {_refusal(allowed, raw) for raw in attempts}
    assert messages == {f"lora_path {REFUSED}"}
    assert str(tree) not in REFUSED


def test_the_model_folder_is_always_allowed_and_roots_are_resolved(tree: Path) -> None:
    (tree / "link-to-model").symlink_to(tree / "model")
    allowed = AllowedPaths.of(tree / "link-to-model")
    assert allowed.roots == (tree / "model",)
    assert allowed.folder(str(tree / "model/transformer"), "x") == tree / "model/transformer"
    _refusal(allowed, str(tree / "loras/style"))


def test_pickle_only_folders_are_refused_by_name(tmp_path: Path) -> None:
    assert pickle_problem(tmp_path, "lora_path") is None  # empty: the loader says so
    (tmp_path / "adapter_config.json").write_text("{}")
    (tmp_path / "adapter_model.bin").write_bytes(b"\x80\x04")
    (tmp_path / "extra.pt").write_bytes(b"\x80\x04")
    problem = pickle_problem(tmp_path, "lora_path")
    assert problem is not None and problem.fields[0].field == "lora_path"
    assert "adapter_model.bin, extra.pt" in str(problem) and "safetensors only" in str(problem)
    # Beside a safetensors file the pickles are never read (use_safetensors=True).
    (tmp_path / "adapter_model.safetensors").write_bytes(b"x")
    assert pickle_problem(tmp_path, "lora_path") is None
