"""The router's Kubernetes pieces against a real apiserver: EndpointSlice discovery
follows ready/terminating/deleted endpoints, and the ConfigMap control state only
moves forward under concurrent writers and survives being deleted."""

from __future__ import annotations

import asyncio
import json
import os
from collections.abc import Iterator
from typing import Any

import pytest
from kubernetes import config

from dpserve.control_state import ControlState, StateDoc
from dpserve.router.desired import DesiredState
from dpserve.router.kubernetes import ConfigMapStateStore, EndpointSliceDiscovery
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


def test_configmap_state_only_moves_forward_and_survives_deletion(cluster: ControlPlane) -> None:
    name = "x-control-state"
    cluster.kubectl("-n", NS, "create", "configmap", name)
    base = StateDoc()
    docs = [base.successor("set_lora", ControlState(loras={"a": f"/l/{i}"})) for i in range(3)]

    async def scenario() -> None:
        routers = [DesiredState(ConfigMapStateStore(NS, name, router=f"r{i}")) for i in range(3)]
        # Three routers race for version 1: compare-and-swap keeps exactly one, everywhere.
        stored = await asyncio.gather(*(r.commit(d) for r, d in zip(routers, docs, strict=True)))
        winner = max(docs, key=lambda d: d.key)
        for router in routers:
            await router.refresh()
            assert router.doc == winner
        assert stored[-1] == winner or winner in stored
        # An older document never overwrites a newer one.
        assert await routers[0].commit(StateDoc(version=0, id="zz")) == winner
        fresh = DesiredState(ConfigMapStateStore(NS, name))
        await fresh.refresh()  # a restarted router reads it
        assert fresh.doc == winner
        # Deleted ConfigMap: ops go on from memory; recreated, the router stores it again.
        cluster.kubectl("-n", NS, "delete", "configmap", name)
        later = winner.successor("release_memory_occupation", ControlState(released=True))
        assert await fresh.commit(later) == later
        cluster.kubectl("-n", NS, "create", "configmap", name)
        await fresh.refresh()
        assert await asyncio.to_thread(ConfigMapStateStore(NS, name).load) == later
        # Out-of-sync replicas are published for the operator; a router rewrites only its own.
        store = ConfigMapStateStore(NS, name, router="r0")
        await asyncio.to_thread(
            store.report, {"tcp://10.0.0.1:5575": "no such LoRA"}, {"tcp://10.0.0.1:5575"}
        )
        other = ConfigMapStateStore(NS, name, router="r1")
        await asyncio.to_thread(other.report, {}, {"tcp://10.0.0.2:5575"})
        raw = cluster.kubectl("-n", NS, "get", "configmap", name, "-o", "jsonpath={.data.replicas}")
        entries = json.loads(raw.stdout)
        assert list(entries) == ["tcp://10.0.0.1:5575"]
        assert entries["tcp://10.0.0.1:5575"]["reason"] == "no such LoRA"
        assert entries["tcp://10.0.0.1:5575"]["router"] == "r0"
        # Garbage in the ConfigMap is read as "nothing stored", never a crash.
        cluster.kubectl("-n", NS, "patch", "configmap", name, "-p", '{"data":{"state":"{oops"}}')
        assert await asyncio.to_thread(ConfigMapStateStore(NS, name).load) is None

    asyncio.run(scenario())
