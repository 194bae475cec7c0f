"""The driver's ingress on its own (a real ROUTER socket, no gang): session refusals
that must not wait behind the gang's queue."""

from __future__ import annotations

import pytest

from dpserve.client import ReplicaClient
from dpserve.contract import protocol as p
from dpserve.contract import realtime as rt
from dpserve.worker.driver import Driver

PARAMS = rt.SessionParams(prompt="a kite", width=64, height=64)


def _client(ingress: Driver) -> ReplicaClient:
    return ReplicaClient(ingress.endpoint, timeout_s=5)


def test_a_full_replica_refuses_opens_at_once(ingress: Driver) -> None:
    ingress.status.sessions = 2
    with _client(ingress) as client:
        with pytest.raises(p.RequestError) as exc:
            client.session(rt.SessionRequest(action="open", session_id="s", params=PARAMS))
        assert exc.value.code == p.OVERLOADED and "maximum of 2 sessions" in str(exc.value)
        ping = client.ping()
    assert (ping.sessions, ping.max_sessions) == (2, 2)
    assert ingress.scheduler.work.qsize() == 0  # refused without queueing


def test_a_draining_replica_ends_sessions_instead_of_asking_for_a_retry(ingress: Driver) -> None:
    ingress.draining.set()
    with _client(ingress) as client:
        with pytest.raises(p.RequestError) as exc:
            client.session(rt.SessionRequest(action="step", session_id="s"))
        assert exc.value.code == p.NOT_FOUND and "sessions end with it" in str(exc.value)
        with pytest.raises(p.RequestError) as exc:
            client.generate(prompt="x")
        assert exc.value.code == p.UNAVAILABLE  # a request may go to another replica
        assert client.ping().status == "draining"
