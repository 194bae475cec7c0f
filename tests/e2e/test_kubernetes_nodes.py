"""Two real nodes: a DiffusionService guarded on both, drained off a node, then a node
lost, under load.

On the real node backend only (``--cluster node``, the default): the session's cluster
grows a second node (tests/cluster/nodelayout.py), both holding the built images. The
example service's two replicas spread over the nodes by the operator's default
topology spread. Kept lean: one service for every test, two clients of load.

- Policy: the replicas' NetworkPolicy keeps a stranger out on either node.
- Drain: ``kubectl drain`` (the real one: cordon, then the Eviction API for each pod,
  which the PodDisruptionBudget governs) empties the node of one replica.
- Loss: a node killed whole (``RealNode.lose()``); the node lifecycle controller marks
  it NotReady, the out-of-service taint says it is gone for good, and the replica comes
  back on the other node. The node is restarted afterwards for the rest of the session.
- A router's node drained: with two routers (one per node), the drain of a node that
  holds a router and a replica fails nothing either.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.e2e.backends import Backend, NodeBackend
from tests.e2e.operator_install import operator_installed
from tests.e2e.test_kubernetes_journey import Load, replica_door, run_probe
from tests.polling import eventually

pytestmark = [pytest.mark.e2e, pytest.mark.cluster, pytest.mark.timeout(1800)]
REPO = Path(__file__).resolve().parents[2]
NS = "nodes"
OUT_OF_SERVICE = "node.kubernetes.io/out-of-service"


@pytest.fixture(scope="module")
def k8s(backend: Backend) -> Iterator[NodeBackend]:
    if not isinstance(backend, NodeBackend):
        pytest.skip("drain and node loss need two real nodes: run with --cluster node")
    backend.ensure_nodes(2)
    with operator_installed(backend, NS):
        backend.kubectl("-n", NS, "apply", "-f", str(REPO / "examples/diffusionservice-cpu.yaml"))
        backend.kubectl("-n", NS, "wait", "--for=condition=Ready", "dsvc/tiny", "--timeout=300s")
        eventually(lambda: serving(backend) == ["0", "1"], 120, "router sees both replicas")
        yield backend
    backend.shrink_to(1)  # the modules after this one were written for one node


def serving(k8s: Backend) -> list[str]:
    """The replicas the router has in rotation."""
    reps = httpx.get(f"{k8s.router_url(NS, 'tiny')}/health/replicas", timeout=5).json()
    return sorted(r["replica"] for r in reps["replicas"] if r["state"] == "serving")


def replica_pods(k8s: Backend) -> dict[str, dict[str, Any]]:
    """The replica pods not being deleted, by name."""
    selector = "app.kubernetes.io/instance=tiny,app.kubernetes.io/component=replica"
    items = k8s.get(NS, "pods", "-l", selector)["items"]
    return {p["metadata"]["name"]: p for p in items if not p["metadata"].get("deletionTimestamp")}


def ready_replicas(k8s: Backend) -> int:
    return int((k8s.get(NS, "dsvc", "tiny").get("status") or {}).get("readyReplicas") or 0)


def router_pods(k8s: Backend) -> list[dict[str, Any]]:
    selector = "app.kubernetes.io/instance=tiny,app.kubernetes.io/component=router"
    items: list[dict[str, Any]] = k8s.get(NS, "pods", "-l", selector)["items"]
    return items


def router_nodes(k8s: Backend) -> set[str]:
    return {p["spec"].get("nodeName", "") for p in router_pods(k8s)}


def spread(k8s: Backend) -> dict[str, str]:
    """Replica pod name → node, once the replicas are on two nodes. After a drain or a
    loss both are on one: one is deleted, and the operator's default topology spread
    puts its replacement on the emptier node."""
    placed = {name: p["spec"].get("nodeName", "") for name, p in replica_pods(k8s).items()}
    if len(set(placed.values())) < 2:
        k8s.kubectl("-n", NS, "delete", "pod", sorted(placed)[-1], "--wait=true")
        eventually(lambda: serving(k8s) == ["0", "1"] and ready_replicas(k8s) == 2, 240,
                   "the replaced replica serving")  # fmt: skip
        placed = {name: p["spec"]["nodeName"] for name, p in replica_pods(k8s).items()}
    assert sorted(placed.values()) == ["node-1", "node-2"], (placed, _nodes_shown(k8s))
    return placed


def _nodes_shown(k8s: Backend) -> list[dict[str, Any]]:
    """What the scheduler weighs of each node, for a placement that went wrong."""
    return [
        {
            "name": n["metadata"]["name"],
            "unschedulable": n["spec"].get("unschedulable", False),
            "taints": n["spec"].get("taints", []),
            "ready": [c["status"] for c in n["status"]["conditions"] if c["type"] == "Ready"],
            "allocatable": n["status"].get("allocatable", {}),
        }
        for n in k8s.get("default", "nodes")["items"]
    ]


def victim_of(k8s: Backend, placed: dict[str, str]) -> tuple[str, str]:
    """A node holding a replica but not the router (the router is one pod: losing it is
    not what these tests measure), and that replica's pod name."""
    routers = router_nodes(k8s)
    node = next(n for n in sorted(set(placed.values())) if n not in routers)
    (pod,) = [name for name, n in placed.items() if n == node]
    return node, pod


class Watch:
    """The service's status sampled in a loop: the lowest readyReplicas seen, and every
    Available condition that was not True."""

    def __init__(self, k8s: Backend) -> None:
        self.k8s = k8s
        self.lowest_ready: int | None = None
        self.unavailable: list[dict[str, Any]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(0.5):
            status = self.k8s.get(NS, "dsvc", "tiny").get("status") or {}
            ready = int(status.get("readyReplicas") or 0)
            self.lowest_ready = (
                ready if self.lowest_ready is None else min(ready, self.lowest_ready)
            )
            conditions = {c["type"]: c for c in status.get("conditions", [])}
            available = conditions.get("Available", {"status": "missing"})
            if available["status"] != "True":
                self.unavailable.append(available)

    def __enter__(self) -> Watch:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=30)


def whole_again(k8s: Backend, pod: str, old_uid: str, left: str) -> Callable[[], bool]:
    """Pod ``pod`` replaced (another uid) on a node other than ``left``, both serving."""

    def check() -> bool:
        now = replica_pods(k8s).get(pod, {})
        return (
            now.get("metadata", {}).get("uid") not in (None, old_uid)
            and now["spec"].get("nodeName") not in (None, left)
            and serving(k8s) == ["0", "1"]
            and ready_replicas(k8s) == 2
        )

    return check


def test_the_replicas_on_either_node_admit_the_router_alone(k8s: NodeBackend) -> None:
    """The one policy engine (with the first node) guards both nodes' replicas: a pod
    without the router's labels, on the other node, cannot open either replica's ZMQ
    port (the copycat and the wire key: test_kubernetes_journey.py)."""
    placed = spread(k8s)
    door = replica_door(k8s, NS)
    for pod, node in sorted(placed.items()):
        ip = replica_pods(k8s)[pod]["status"]["podIP"]
        stranger = door.stranger(f"stranger-{node}", ip)
        (stranger["spec"]["nodeName"],) = set(placed.values()) - {node}
        logs, _ = run_probe(k8s, stranger, NS)
        assert logs.startswith("tcp: ") and "tcp: open" not in logs, (pod, node, logs)


def drain_under_load(k8s: NodeBackend, victim: str, whole: Callable[[], bool]) -> float:
    """``kubectl drain`` of ``victim`` under load until ``whole()``, then uncordoned:
    nothing failed, a replica stayed Ready throughout (2 replicas, maxUnavailable 1)
    and the status said so (Available never went False; Ready did, for the moved
    one). Prints the figures; returns how long the drain itself took."""
    try:
        with Load(lambda: k8s.router_url(NS, "tiny")) as load, Watch(k8s) as watch:
            eventually(lambda: len(load.served) >= 2, 120, "load flowing")
            started = time.monotonic()
            drained = k8s.kubectl(
                "drain", victim, "--ignore-daemonsets", "--delete-emptydir-data",
                "--timeout=300s", check=False,
            )  # fmt: skip
            drain_s = time.monotonic() - started
            assert drained.returncode == 0, drained.stderr
            eventually(whole, 300, f"the service whole again after the drain of {victim}")
            whole_s = time.monotonic() - started
            served = len(load.served)
            eventually(lambda: len(load.served) > served + 2, 60, "load after the drain")
    finally:
        k8s.kubectl("uncordon", victim)
    print(f"drain of {victim}: kubectl drain {drain_s:.1f} s, service whole after {whole_s:.1f} s")
    assert load.failures == [], load.failures[:5]
    assert watch.lowest_ready is not None and watch.lowest_ready >= 1
    assert watch.unavailable == [], watch.unavailable[:3]
    return drain_s


def test_a_drain_under_load_fails_nothing_and_moves_the_replica(k8s: NodeBackend) -> None:
    assert k8s.get(NS, "pdb", "tiny-replicas")["spec"]["maxUnavailable"] == 1
    victim, moved = victim_of(k8s, spread(k8s))
    old_uid = replica_pods(k8s)[moved]["metadata"]["uid"]
    drain_s = drain_under_load(k8s, victim, whole_again(k8s, moved, old_uid, victim))
    # Drained, not killed: the evicted pod was gone well before its grace period's end
    # (request timeout + margin): the worker drains on SIGTERM, then exits.
    grace = replica_pods(k8s)[moved]["spec"]["terminationGracePeriodSeconds"]
    assert drain_s < grace, (drain_s, grace)


def test_a_lost_node_replica_comes_back_on_the_other_node(k8s: NodeBackend) -> None:
    victim, lost = victim_of(k8s, spread(k8s))
    old_uid = replica_pods(k8s)[lost]["metadata"]["uid"]
    node = next(n for n in k8s.cluster.nodes if n.name == victim)

    def node_ready() -> str:
        got = k8s.get("default", "node", victim)
        return str(next(c["status"] for c in got["status"]["conditions"] if c["type"] == "Ready"))

    try:
        with Load(lambda: k8s.router_url(NS, "tiny")) as load:
            eventually(lambda: len(load.served) >= 2, 120, "load flowing")
            started = time.monotonic()
            node.lose()
            # The router notices first: the replica's pings fail, what it held is retried.
            eventually(lambda: serving(k8s) == sorted(set("01") - {lost[-1]}), 60,
                       "the router drops the lost replica")  # fmt: skip
            dropped_s = time.monotonic() - started
            eventually(lambda: node_ready() != "True", 120, "the node marked NotReady")
            detected_s = time.monotonic() - started
            # What tells Kubernetes the node is gone for good (non-graceful node
            # shutdown): its pods are deleted and, their kubelet being gone, removed by
            # the pod GC; only then is the replica's name free to be used again.
            k8s.kubectl("taint", "node", victim, f"{OUT_OF_SERVICE}=nodeshutdown:NoExecute")
            eventually(whole_again(k8s, lost, old_uid, victim), 300, "the replica back, serving")
            whole_s = time.monotonic() - started
        print(
            f"loss of {victim}: router dropped the replica after {dropped_s:.1f} s, node "
            f"NotReady after {detected_s:.1f} s, service whole after {whole_s:.1f} s"
        )
        assert load.failures == [], load.failures[:5]
    finally:  # the node back for the rest of the session, as a repaired machine returns
        node.stop()
        node.start()
        k8s.kubectl("taint", "node", victim, f"{OUT_OF_SERVICE}-", check=False)


def ready_routers(k8s: Backend) -> dict[str, str]:
    """Router pod name → node, for the Ready routers not being deleted."""
    return {
        p["metadata"]["name"]: p["spec"].get("nodeName", "")
        for p in router_pods(k8s)
        if not p["metadata"].get("deletionTimestamp")
        and any(c["type"] == "Ready" and c["status"] == "True"
                for c in p["status"].get("conditions", []))
    }  # fmt: skip


def test_a_drain_of_a_routers_node_fails_nothing_with_two_routers(k8s: NodeBackend) -> None:
    """What docs/operator.md tells a cluster whose nodes are drained: two routers, spread
    over the nodes, each budgeted (``tiny-router``, maxUnavailable 1). The drained node
    holds a router and a replica; the other router serves while both come back."""
    two = json.dumps({"spec": {"router": {"replicas": 2}}})
    k8s.kubectl("-n", NS, "patch", "dsvc", "tiny", "--type=merge", "-p", two)
    try:
        eventually(lambda: sorted(ready_routers(k8s).values()) == ["node-1", "node-2"], 180,
                   "a router Ready on each node (the routers' spread)")  # fmt: skip
        assert k8s.get(NS, "pdb", "tiny-router")["spec"]["maxUnavailable"] == 1
        placed = spread(k8s)
        victim = "node-2"
        (moved,) = [pod for pod, node in placed.items() if node == victim]
        replica_back = whole_again(k8s, moved, replica_pods(k8s)[moved]["metadata"]["uid"], victim)
        drain_under_load(k8s, victim, lambda: replica_back() and len(ready_routers(k8s)) == 2)
    finally:
        one = json.dumps({"spec": {"router": {"replicas": 1}}})
        k8s.kubectl("-n", NS, "patch", "dsvc", "tiny", "--type=merge", "-p", one)
