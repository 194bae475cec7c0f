"""Placement and disruption against a real kube-apiserver and scheduler (no kubelet).

The CRD refuses bad placement fields at apply time; the operator keeps a
PodDisruptionBudget per service for its replicas and one for its routers (the routers'
pause and spread as the apiserver took them), and puts the spread, anti-affinity and
priority class on the replica pods; a priorityClassName with no PriorityClass makes the apiserver
refuse the pod (Priority admission), which status reports with the apiserver's words
while the operator keeps running; and the scheduler's refusal of a second replica on
the only node (onePerNode) shows in status. The nodes here are Node objects with no
kubelet behind them: the scheduler binds pods to them, nothing runs.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest

from tests.cluster.controlplane import ControlPlane
from tests.integration.test_operator_apiserver import REPO, Operator
from tests.polling import eventually

pytestmark = pytest.mark.cluster
NS = "op-place"
PRIORITY = "dpserve-test-high"


@pytest.fixture(scope="module")
def cluster(control_plane: ControlPlane) -> ControlPlane:
    plane = control_plane
    plane.kubectl("apply", "-f", str(REPO / "charts/dpserve/crds"))
    plane.kubectl("wait", "--for=condition=Established", "crd/diffusionservices.dpserve.dev")
    plane.kubectl("create", "namespace", NS)
    eventually(
        lambda: plane.kubectl("-n", NS, "get", "sa", "default", check=False).returncode == 0,
        what="default service account",
    )
    return plane


@pytest.fixture(scope="module")
def operator(cluster: ControlPlane) -> Iterator[Operator]:
    op = Operator(cluster, NS).start()
    try:
        yield op
    finally:
        op.stop()


def get(cluster: ControlPlane, *what: str) -> Any:
    return json.loads(cluster.kubectl("-n", NS, "get", *what, "-o", "json").stdout)


def apply(cluster: ControlPlane, manifest: dict[str, Any], check: bool = True) -> Any:
    return cluster.kubectl("apply", "-f", "-", input=json.dumps(manifest), check=check)


def dsvc(name: str, **spec: Any) -> dict[str, Any]:
    return {
        "apiVersion": "dpserve.dev/v1alpha1",
        "kind": "DiffusionService",
        "metadata": {"name": name, "namespace": NS},
        "spec": {"model": {"path": "/models/tiny"}, "device": "cpu", **spec},
    }


def pods(cluster: ControlPlane, name: str) -> dict[str, dict[str, Any]]:
    selector = f"app.kubernetes.io/instance={name},app.kubernetes.io/component=replica"
    return {p["metadata"]["name"]: p for p in get(cluster, "pods", "-l", selector)["items"]}


def status(cluster: ControlPlane, name: str) -> dict[str, Any]:
    return get(cluster, "dsvc", name).get("status") or {}


def degraded(cluster: ControlPlane, name: str) -> dict[str, Any]:
    conditions = status(cluster, name).get("conditions") or []
    return next((c for c in conditions if c["type"] == "Degraded"), {})


def test_the_crd_refuses_bad_placement_fields(cluster: ControlPlane) -> None:
    for spec, words in [
        ({"topologySpreadConstraints": [{"topologyKey": "k", "whenUnsatisfiable": "Maybe"}]},
         "whenUnsatisfiable"),
        ({"topologySpreadConstraints": [{"topologyKey": "k", "maxSkew": 0}]}, "maxSkew"),
        ({"topologySpreadConstraints": [{"topologyKey": "k", "minDomains": 2}]},
         "minDomains needs whenUnsatisfiable DoNotSchedule"),
        ({"topologySpreadConstraints": [{"maxSkew": 1}]}, "topologyKey"),
        ({"priorityClassName": "Not_A_Name"}, "priorityClassName"),
        ({"onePerNode": "yes"}, "onePerNode"),
    ]:  # fmt: skip
        refused = apply(cluster, dsvc("bad-placement", **spec), check=False)
        assert refused.returncode != 0, spec
        assert words in refused.stderr, (spec, refused.stderr)


def test_budget_pod_fields_and_a_refused_priority_class_in_status(
    cluster: ControlPlane, operator: Operator
) -> None:
    zone = {"topologyKey": "topology.kubernetes.io/zone", "whenUnsatisfiable": "DoNotSchedule"}
    apply(
        cluster,
        dsvc(
            "placed",
            replicas=2,
            updateStrategy={"maxUnavailable": 2},
            topologySpreadConstraints=[zone],
            onePerNode=True,
        ),
    )
    budget = eventually(
        lambda: get(cluster, "pdb", "placed-replicas"), what="the PodDisruptionBudget"
    )
    assert budget["metadata"]["ownerReferences"][0]["name"] == "placed"
    assert budget["spec"]["maxUnavailable"] == 2
    assert budget["spec"]["unhealthyPodEvictionPolicy"] == "AlwaysAllow"
    selector = budget["spec"]["selector"]["matchLabels"]
    assert selector["app.kubernetes.io/component"] == "replica"
    # The routers' own budget, and their pause and spread, as the apiserver took them.
    routers = eventually(lambda: get(cluster, "pdb", "placed-router"), what="the routers' budget")
    assert routers["spec"]["maxUnavailable"] == 1
    router_selector = routers["spec"]["selector"]["matchLabels"]
    assert router_selector["app.kubernetes.io/component"] == "router"
    template = get(cluster, "deployment", "placed-router")["spec"]["template"]
    assert router_selector.items() <= template["metadata"]["labels"].items()
    (container,) = template["spec"]["containers"]
    assert container["lifecycle"]["preStop"] == {"sleep": {"seconds": 5}}
    assert template["spec"]["topologySpreadConstraints"][0]["labelSelector"] == {
        "matchLabels": router_selector
    }
    made = eventually(lambda: len(pods(cluster, "placed")) == 2 and pods(cluster, "placed"))
    for pod in made.values():
        assert selector.items() <= pod["metadata"]["labels"].items()
        spread = pod["spec"]["topologySpreadConstraints"]
        assert spread == [{**zone, "maxSkew": 1, "labelSelector": {"matchLabels": selector}}]
        anti = pod["spec"]["affinity"]["podAntiAffinity"]
        assert anti["requiredDuringSchedulingIgnoredDuringExecution"][0]["topologyKey"] == (
            "kubernetes.io/hostname"
        )
        assert "priorityClassName" not in pod["spec"]
    # Fewer replicas may go at once than the roll allows? Never below one: a drain of the
    # only replica must not hang (docs/kubernetes.md).
    apply(cluster, dsvc("placed", replicas=1, updateStrategy={"maxUnavailable": 0, "maxSurge": 1}))
    eventually(
        lambda: get(cluster, "pdb", "placed-replicas")["spec"]["maxUnavailable"] == 1,
        what="a budget of at least one",
    )

    # A priority class that does not exist: the apiserver refuses the pods.
    apply(cluster, dsvc("placed", replicas=1, priorityClassName=PRIORITY))
    refusal = eventually(
        lambda: (
            degraded(cluster, "placed").get("reason") == "PodCreateRefused"
            and degraded(cluster, "placed")
        ),
        what="the refused create in status",
    )
    assert f"no PriorityClass with name {PRIORITY} was found" in refusal["message"]
    replica = status(cluster, "placed")["replicaStatuses"][0]
    assert replica["reason"] == "PodCreateRefused" and PRIORITY in replica["message"]
    events = get(cluster, "events", "--field-selector", "involvedObject.name=placed")
    assert any(e["reason"] == "PodCreateRefused" for e in events["items"])
    assert operator.alive()

    # Once the class exists, the drift check creates the pod with it.
    cluster.kubectl(
        "apply", "-f", "-",
        input=json.dumps({
            "apiVersion": "scheduling.k8s.io/v1", "kind": "PriorityClass",
            "metadata": {"name": PRIORITY}, "value": 1000,
        }),
    )  # fmt: skip
    try:
        pod = eventually(
            lambda: pods(cluster, "placed").get("placed-replica-0"),
            timeout_s=60,
            what="the replica created once its class exists",
        )
        assert pod["spec"]["priorityClassName"] == PRIORITY and pod["spec"]["priority"] == 1000
        eventually(
            lambda: degraded(cluster, "placed").get("reason") != "PodCreateRefused",
            what="the refusal cleared",
        )
    finally:
        cluster.kubectl("delete", "priorityclass", PRIORITY, "--wait=false", check=False)
        cluster.kubectl("-n", NS, "delete", "dsvc", "placed", "--wait=false", check=False)


def _node(name: str) -> dict[str, Any]:
    room = {"cpu": "16", "memory": "64Gi", "pods": "110"}
    return {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {"name": name, "labels": {"kubernetes.io/hostname": name}},
        "status": {"capacity": room, "allocatable": room},
    }


def test_one_replica_per_node_shows_the_schedulers_refusal(
    cluster: ControlPlane, operator: Operator
) -> None:
    # A Node object with no kubelet: new nodes are tainted not-ready, so the replicas
    # tolerate everything; the scheduler binds one and refuses the other.
    apply(cluster, _node("place-node-a"))
    try:
        apply(
            cluster,
            dsvc("alone", replicas=2, onePerNode=True, tolerations=[{"operator": "Exists"}]),
        )
        stuck = eventually(
            lambda: (
                degraded(cluster, "alone").get("reason") == "Unschedulable"
                and degraded(cluster, "alone")
            ),
            what="the scheduler's refusal in status",
        )
        assert "didn't match pod anti-affinity rules" in stuck["message"]
        placed = [r for r in status(cluster, "alone")["replicaStatuses"] if r.get("node")]
        assert [r["node"] for r in placed] == ["place-node-a"]
    finally:
        # Other modules expect no node at all; bound pods here never finish terminating.
        cluster.kubectl("-n", NS, "delete", "dsvc", "alone", "--wait=false", check=False)
        cluster.kubectl("delete", "node", "place-node-a", "--wait=false", check=False)
        cluster.kubectl(
            "-n", NS, "delete", "pods", "--all", "--force", "--grace-period=0", check=False
        )
