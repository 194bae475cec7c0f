"""Fixtures of the tests against the real S3 server."""

from __future__ import annotations

import os

import pytest

from tests.storage.s3 import S3Server


@pytest.fixture
def aws_env(s3_server: S3Server, monkeypatch: pytest.MonkeyPatch) -> dict[str, str]:
    """This process's (and its children's) AWS_* variables point at the test server."""
    for name in [n for n in os.environ if n.startswith("AWS_")]:
        monkeypatch.delenv(name)
    for name, value in s3_server.env().items():
        monkeypatch.setenv(name, value)
    return s3_server.env()
