"""What a driver's pings say about its load (a real ROUTER socket, no gang behind it):
the cost units queued, its calibration, the busy window and the batch size."""

from __future__ import annotations

import time

import pytest

from dpserve.client import ReplicaClient
from dpserve.contract import protocol as p
from dpserve.contract.cost import cost_units
from dpserve.worker.driver import Driver
from tests.polling import eventually


def _queue(ingress: Driver, client: ReplicaClient, body: dict[str, object]) -> None:
    """Queue a generation (nothing runs it: no gang), once the ingress holds it."""
    queued = ingress.scheduler.work.qsize()
    client.send_raw(p.encode(p.GENERATE, f"r{queued}", body))
    deadline = time.monotonic() + 5
    while ingress.scheduler.work.qsize() == queued:
        assert time.monotonic() < deadline, "the generation never queued"
        time.sleep(0.01)


def test_pings_report_queued_units_calibration_busy_share_and_batch(ingress: Driver) -> None:
    shape = p.CostReport(default_width=512, default_height=512, default_steps=8)
    ingress.status.calibration.configure(shape)
    ingress.status.max_batch = 4
    with ReplicaClient(ingress.endpoint, timeout_s=5) as client:
        idle = client.ping()
        assert idle.outstanding_units == 0 and idle.max_batch == 4
        assert idle.cost is not None and idle.cost.seconds_per_unit is None
        assert idle.cost.default_width == 512 and idle.busy_fraction == 0
        small = {"prompt": "x", "width": 64, "height": 64, "num_inference_steps": 2}
        _queue(ingress, client, small)
        _queue(ingress, client, {"prompt": "y", "n": 2})  # the replica's defaults
        expected = cost_units(p.GenerateParams(prompt="x", width=64, height=64,
                                               num_inference_steps=2), shape)  # fmt: skip
        expected += cost_units(p.GenerateParams(prompt="y", n=2), shape)
        assert client.ping().outstanding_units == pytest.approx(expected)
        ingress.status.calibration.observe(2.0, 1.0)
        ingress.status.busy = True
        # Busy since then: a share shows once a millisecond of the 20 s window has
        # passed (the ping rounds it to 4 places).
        eventually(lambda: client.ping().busy_fraction > 0, timeout_s=10, poll_s=0.01)
        ping = client.ping()
    assert ping.cost is not None and ping.cost.seconds_per_unit == pytest.approx(0.5)
    assert ping.cost.samples == 1 and ping.busy
    assert 0 < ping.busy_fraction < 0.1  # well under 2 s of a 20 s window
