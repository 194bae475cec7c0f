"""The router's Kubernetes pieces against a real apiserver: EndpointSlice discovery
follows ready/terminating/deleted endpoints, the ConfigMap control state only
moves forward under concurrent writers and survives being deleted, and two routers
over one ConfigMap (and the same replicas, tests/stub_replica.py) compose their ops,
a router that loses the compare-and-swap building its op on the winner's."""

from __future__ import annotations

import asyncio
import json
import os
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager
from typing import Any

import pytest
import zmq.asyncio
from kubernetes import config

from dpserve.contract.control_state import ControlState, StateDoc
from dpserve.router.desired import DesiredState
from dpserve.router.kubernetes import ConfigMapStateStore, EndpointSliceDiscovery
from dpserve.router.pool import PoolSettings, ReplicaPool
from dpserve.router.service import RouterService
from tests.cluster.controlplane import ControlPlane
from tests.polling import until
from tests.stub_replica import StubReplica, run_in_context

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
        # A short period: the test waits for one re-list, and stop() waits out the
        # watch then open (the watch's server-side timeout is the period).
        discovery = EndpointSliceDiscovery(NS, "x-replicas", on_change, relist_s=2)
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
            # Across a re-list (its watch ends within relist_s; the list then publishes
            # again, changed or not): nothing stale comes back.
            published = len(seen)
            await until(lambda: len(seen) > published, timeout_s=20)
            assert all(s == {"tcp://10.244.0.7:5575"} for s in seen[published:])
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
        # Three routers race for version 1, each built on the boot state: compare-and-swap
        # keeps exactly one (the first written: the others did not know it), everywhere.
        stored = await asyncio.gather(*(r.commit(d) for r, d in zip(routers, docs, strict=True)))
        winner = stored[0]
        assert winner in docs and stored == [winner] * 3
        for router in routers:
            await router.refresh()
            assert router.doc == winner
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


# ---------------------------------------------------------------- two routers, one ConfigMap

STYLE = {"lora_nickname": "style", "lora_path": "/loras/style"}
OTHER = {"lora_nickname": "other", "lora_path": "/loras/other"}
FAST = PoolSettings(ping_interval_s=0.2, ping_timeout_s=2, control_timeout_s=10)


class _Interrupted(ConfigMapStateStore):
    """A router's store where, between this router's read and its first write of an op,
    ``interrupt`` runs (another router's whole op)."""

    interrupt: Callable[[], None] | None = None

    def advance(self, doc: StateDoc) -> StateDoc:
        interrupt, self.interrupt = self.interrupt, None
        if interrupt is not None:
            interrupt()
        return super().advance(doc)


@asynccontextmanager
async def _router(
    stubs: list[StubReplica], store: ConfigMapStateStore
) -> AsyncIterator[RouterService]:
    pool = ReplicaPool(FAST, desired=DesiredState(store))
    await pool.set_endpoints(s.endpoint for s in stubs)
    await pool.start()
    try:
        await until(lambda: len(pool.serving()) == len(stubs), timeout_s=10)
        yield RouterService(pool)
    finally:
        await pool.close()


def test_two_routers_on_one_configmap_compose_their_ops(cluster: ControlPlane) -> None:
    name = "two-routers-state"
    cluster.kubectl("-n", NS, "create", "configmap", name)
    ops: list[tuple[str, dict[str, Any]]] = [
        ("set_lora", STYLE),
        ("set_lora", OTHER),
        ("set_lora", {"lora_nickname": ["style", "other"], "strength": [1.0, 0.5]}),
        ("merge_lora_weights", {"strength": 0.8}),
    ]

    async def scenario(ctx: zmq.asyncio.Context) -> None:
        stubs = [StubReplica(ctx, replica=i) for i in range(2)]
        store_b = _Interrupted(NS, name, router="b")
        async with (
            _router(stubs, ConfigMapStateStore(NS, name, router="a")) as a,
            _router(stubs, store_b) as b,
        ):
            # Back to back through alternating routers: each is built on the other's.
            for i, (op, args) in enumerate(ops):
                done = await (a, b)[i % 2].control(op, args)
                assert done.status == 200, (op, done.body)
            assert (await a.control("unmerge_lora_weights", {})).status == 200
            # b reads the ConfigMap, then a's whole op is stored and sent before b writes:
            # b's write loses the compare-and-swap, and b builds its op on a's.
            loop = asyncio.get_running_loop()
            theirs: list[Any] = []

            def a_op_first() -> None:
                release = a.control("set_lora", {"lora_nickname": "style", "strength": 0.3})
                theirs.append(asyncio.run_coroutine_threadsafe(release, loop).result(30))

            store_b.interrupt = a_op_first
            done = await b.control("set_lora", {**OTHER, "strength": 0.6})
            assert theirs[0].status == 200, theirs[0].body
            assert done.status == 200, done.body
            assert (
                done.body["control_state"]["rebased_on"]
                == theirs[0].body["control_state"]["version"]
            )
            want = ControlState(
                loras={"style": "/loras/style", "other": "/loras/other"}, active={"other": 0.6}
            )
            stored = await asyncio.to_thread(ConfigMapStateStore(NS, name).load)
            assert stored is not None and stored.state == want
            assert stored.version == done.body["control_state"]["version"] == len(ops) + 3
            assert [s.held for s in stubs] == [stored, stored]
            assert b.pool.desired.doc == stored
            await until(lambda: a.pool.desired.doc == stored)  # from the ConfigMap or a ping
        for stub in stubs:
            await stub.close()

    run_in_context(scenario)
