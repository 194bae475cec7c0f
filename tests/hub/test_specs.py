"""What the hub fixture refuses before it starts anything, and how it says so."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.hub.gate import check_token
from tests.hub.repo import RepoSpec, publish


@pytest.mark.parametrize("repo_id", ["tiny", "/tiny", "dpserve/", "a/b/c"])
def test_a_repository_id_is_org_slash_name(repo_id: str, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="a repository id is ORG/NAME"):
        publish(RepoSpec(repo_id, (tmp_path,)), tmp_path / "mirrors")
    assert not (tmp_path / "mirrors").exists()


def test_a_repository_needs_a_folder(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="at least one folder"):
        publish(RepoSpec("dpserve/empty", ()), tmp_path / "mirrors")


@pytest.mark.parametrize("token", ["short", 'hf_"quoted"_token', "hf token with spaces"])
def test_a_gate_token_needs_no_quoting(token: str) -> None:
    with pytest.raises(ValueError, match=r"8-128 of \[A-Za-z0-9_-\]"):
        check_token(token)
    assert check_token("hf_test_private_token") == "hf_test_private_token"
