"""The router's Kubernetes pieces against a real apiserver: EndpointSlice discovery
follows ready/terminating/deleted endpoints, and the ConfigMap log survives
concurrent writers."""

from __future__ import annotations

import asyncio
import json
import os
from collections.abc import Iterator
from typing import Any

import pytest
from kubernetes import config

from dpserve.router.control_log import ControlLog
from dpserve.router.kubernetes import ConfigMapLogStore, EndpointSliceDiscovery
from tests.cluster.controlplane import ControlPlane

pytestmark = pytest.mark.cluster
NS = "router-test"


@pytest.fixture(scope="module")
def cluster(control_plane: ControlPlane) -> Iterator[ControlPlane]:
    control_plane.kubectl("create", "namespace", NS)
    old = os.environ.get("KUBECONFIG")
    os.environ["KUBECONFIG"] = str(control_plane.kubeconfig)
    config.load_kube_config(config_file=str(control_plane.kubeconfig))
    try:
        yield control_plane
    finally:
        if old is None:
            os.environ.pop("KUBECONFIG", None)
        else:
            os.environ["KUBECONFIG"] = old


def _slice(name: str, *endpoints: tuple[str, bool, bool]) -> dict[str, Any]:
    return {
        "apiVersion": "discovery.k8s.io/v1",
        "kind": "EndpointSlice",
        "metadata": {
            "name": name,
            "namespace": NS,
            "labels": {"kubernetes.io/service-name": "x-replicas"},
        },
        "addressType": "IPv4",
        "ports": [{"name": "zmq", "port": 5575, "protocol": "TCP"}],
        "endpoints": [
            {"addresses": [ip], "conditions": {"ready": ready, "terminating": terminating}}
            for ip, ready, terminating in endpoints
        ],
    }


def _apply(cluster: ControlPlane, obj: dict[str, Any]) -> None:
    cluster.kubectl("apply", "-f", "-", input=json.dumps(obj))


async def _until(seen: list[set[str]], want: set[str], timeout_s: float = 20) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not (seen and seen[-1] == want):
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(f"discovery saw {seen[-1:]} not {want}")
        await asyncio.sleep(0.1)


def test_discovery_follows_ready_endpoints(cluster: ControlPlane) -> None:
    seen: list[set[str]] = []

    async def on_change(endpoints: set[str]) -> None:
        seen.append(endpoints)

    async def scenario() -> None:
        _apply(cluster, _slice("x-a", ("10.244.0.5", True, False), ("10.244.0.6", False, False)))
        discovery = EndpointSliceDiscovery(NS, "x-replicas", on_change, relist_s=5)
        await discovery.start()
        try:
            await _until(seen, {"tcp://10.244.0.5:5575"})
            _apply(cluster, _slice("x-a", ("10.244.0.5", True, False), ("10.244.0.6", True, False)))
            await _until(seen, {"tcp://10.244.0.5:5575", "tcp://10.244.0.6:5575"})
            # Scale-down: the endpoint turns terminating (it drains) and leaves at once.
            _apply(cluster, _slice("x-a", ("10.244.0.5", True, False), ("10.244.0.6", True, True)))
            await _until(seen, {"tcp://10.244.0.5:5575"})
            _apply(cluster, _slice("x-b", ("10.244.0.7", True, False)))
            await _until(seen, {"tcp://10.244.0.5:5575", "tcp://10.244.0.7:5575"})
            cluster.kubectl("-n", NS, "delete", "endpointslice", "x-a")
            await _until(seen, {"tcp://10.244.0.7:5575"})
            await asyncio.sleep(6)  # across a re-list: nothing stale comes back
            assert seen[-1] == {"tcp://10.244.0.7:5575"}
        finally:
            await discovery.stop()

    asyncio.run(scenario())


def test_configmap_log_keeps_every_writer(cluster: ControlPlane) -> None:
    cluster.kubectl("-n", NS, "create", "configmap", "x-control-log", "--from-literal=log=[]")

    async def scenario() -> None:
        routers = [ControlLog(ConfigMapLogStore(NS, "x-control-log")) for _ in range(3)]
        positions = await asyncio.gather(
            *(log.reserve("set_lora", {"router": i}) for i, log in enumerate(routers))
        )
        assert sorted(positions) == [1, 2, 3]  # compare-and-swap: nobody overwrote anybody
        for log, position in zip(routers, positions, strict=True):
            await log.resolve(position, applied=True)
        fresh = ControlLog(ConfigMapLogStore(NS, "x-control-log"))
        await fresh.refresh()  # a restarted router sees it all
        assert sorted(args["router"] for _, _, args in fresh.since(0)) == [0, 1, 2]
        assert all(entry.state == "done" for entry in fresh.entries)

    asyncio.run(scenario())
