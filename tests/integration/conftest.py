"""Fixtures of the integration tier."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from dpserve.contract import validation as pv
from dpserve.worker.commands import GangStatus
from dpserve.worker.driver import Driver
from tests.workers import free_port


@pytest.fixture()
def ingress() -> Iterator[Driver]:
    """A driver's ingress alone (no gang behind it): queue limit 8, 2 sessions."""
    front = Driver(f"tcp://127.0.0.1:{free_port()}", 0, pv.Limits(), GangStatus(), 8, 120.0, 2)
    front.start()
    try:
        yield front
    finally:
        front.close()
