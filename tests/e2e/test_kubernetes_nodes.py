"""Two real nodes: a DiffusionService drained off one of them under load.

On the real node backend only (``--cluster node``, the default): the session's cluster
grows a second node (tests/cluster/nodelayout.py), which both hold the built images.
The example service's two replicas spread over the nodes by the operator's default
topology spread; ``kubectl drain`` (the real one: cordon, then the Eviction API for
each pod, which the PodDisruptionBudget governs) empties the node of one replica
while two clients send requests through the router. Kept lean: one service, one drain.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.e2e.backends import Backend, NodeBackend
from tests.e2e.operator_install import operator_installed
from tests.e2e.test_kubernetes_journey import Load, replica_pods, serving, status
from tests.polling import eventually

pytestmark = [pytest.mark.e2e, pytest.mark.cluster, pytest.mark.timeout(1800)]
REPO = Path(__file__).resolve().parents[2]
NS = "nodes"


@pytest.fixture(scope="module")
def k8s(backend: Backend) -> Iterator[Backend]:
    if not isinstance(backend, NodeBackend):
        pytest.skip("a drain needs two real nodes: run with --cluster node (the default)")
    backend.ensure_nodes(2)
    with operator_installed(backend, NS):
        yield backend


def router_nodes(k8s: Backend) -> set[str]:
    selector = "app.kubernetes.io/instance=tiny,app.kubernetes.io/component=router"
    return {p["spec"].get("nodeName", "") for p in k8s.get(NS, "pods", "-l", selector)["items"]}


class Watch:
    """The service's status sampled in a loop: the lowest readyReplicas seen."""

    def __init__(self, k8s: Backend) -> None:
        self.k8s = k8s
        self.lowest_ready: int | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(0.5):
            ready = int(status(self.k8s, "tiny").get("readyReplicas") or 0)
            self.lowest_ready = (
                ready if self.lowest_ready is None else min(ready, self.lowest_ready)
            )

    def __enter__(self) -> Watch:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=30)


def test_a_drain_under_load_fails_nothing_and_moves_the_replica(k8s: Backend) -> None:
    k8s.kubectl("-n", NS, "apply", "-f", str(REPO / "examples/diffusionservice-cpu.yaml"))
    k8s.kubectl("-n", NS, "wait", "--for=condition=Ready", "dsvc/tiny", "--timeout=300s")
    eventually(lambda: serving(k8s) == ["0", "1"], 120, "router sees both replicas")
    budget = k8s.get(NS, "pdb", "tiny-replicas")
    assert budget["spec"]["maxUnavailable"] == 1

    # The default topology spread puts one replica on each node.
    placed = {name: p["spec"]["nodeName"] for name, p in replica_pods(k8s).items()}
    assert sorted(placed.values()) == ["node-1", "node-2"], placed
    # Drain the node without the router: one router replica is not what this measures.
    routers = router_nodes(k8s)
    victim = next(n for n in sorted(set(placed.values())) if n not in routers)
    (moved,) = [name for name, node in placed.items() if node == victim]
    old_uid = replica_pods(k8s)[moved]["metadata"]["uid"]

    with Load(lambda: k8s.router_url(NS, "tiny")) as load, Watch(k8s) as watch:
        eventually(lambda: len(load.served) >= 2, 120, "load flowing")
        started = time.monotonic()
        drained = k8s.kubectl(
            "drain", victim, "--ignore-daemonsets", "--delete-emptydir-data", "--timeout=300s",
            check=False,
        )  # fmt: skip
        drain_s = time.monotonic() - started
        assert drained.returncode == 0, drained.stderr

        def whole() -> bool:
            pods = replica_pods(k8s)
            pod = pods.get(moved, {})
            return (
                pod.get("metadata", {}).get("uid") not in (None, old_uid)
                and pod["spec"].get("nodeName") not in (None, victim)
                and serving(k8s) == ["0", "1"]
                and status(k8s).get("readyReplicas") == 2
            )

        eventually(whole, 300, "the replica recreated on the other node and serving")
        whole_s = time.monotonic() - started
        served_before = len(load.served)
        eventually(lambda: len(load.served) > served_before + 2, 60, "load after the drain")
    k8s.kubectl("uncordon", victim)

    print(f"drain of {victim}: kubectl drain {drain_s:.1f} s, service whole after {whole_s:.1f} s")
    assert load.failures == [], load.failures[:5]
    # The budget held: one replica stayed Ready throughout (2 replicas, maxUnavailable 1).
    assert watch.lowest_ready is not None and watch.lowest_ready >= 1
    # Drained, not killed: the evicted pod left well before its grace period's end
    # (request timeout + margin), because the worker drains on SIGTERM and exits.
    grace = int(json.loads(k8s.kubectl("-n", NS, "get", "pod", moved, "-o", "json").stdout)
                ["spec"]["terminationGracePeriodSeconds"])  # fmt: skip
    assert drain_s < grace, (drain_s, grace)
    assert all(p["spec"]["nodeName"] != victim for p in replica_pods(k8s).values())
    k8s.kubectl("-n", NS, "delete", "dsvc", "tiny", "--wait=true", "--timeout=120s")
