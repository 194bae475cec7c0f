"""EndpointSlices to replica endpoints: only ready, non-terminating addresses count."""

from __future__ import annotations

from dpserve.router.kubernetes import ready_endpoints


def _slice(*endpoints: dict[str, object], port: int = 5575) -> dict[str, object]:
    return {"ports": [{"name": "zmq", "port": port}], "endpoints": list(endpoints)}


def _ep(ip: str, **conditions: bool) -> dict[str, object]:
    return {"addresses": [ip], "conditions": conditions}


def test_ready_endpoints_only() -> None:
    slices = [
        _slice(
            _ep("10.244.0.5", ready=True),
            _ep("10.244.0.6", ready=False),
            _ep("10.244.0.7", ready=True, terminating=True),  # draining after scale-down
            _ep("10.244.0.8"),  # unset ready means ready
        ),
        _slice(_ep("fd00::9", ready=True), port=6000),
    ]
    assert ready_endpoints(slices) == {
        "tcp://10.244.0.5:5575",
        "tcp://10.244.0.8:5575",
        "tcp://[fd00::9]:6000",
    }


def test_slices_without_ports_or_endpoints_are_ignored() -> None:
    assert ready_endpoints([{"ports": None, "endpoints": [_ep("10.0.0.1")]}]) == set()
    assert ready_endpoints([{"ports": [{"port": 7}], "endpoints": None}]) == set()
    unnamed = {"ports": [{"port": 7000}], "endpoints": [_ep("10.0.0.2", ready=True)]}
    assert ready_endpoints([unnamed]) == {"tcp://10.0.0.2:7000"}
