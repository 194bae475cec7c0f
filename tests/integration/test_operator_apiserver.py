"""The operator against a real kube-apiserver (with controller-manager and scheduler).

There is no kubelet here (the node-level e2e brings a test kubelet): pods stay
unbound, the real scheduler marks them Unschedulable, and where a journey needs
a Ready replica the test plays the kubelet's part by writing the pod's Ready
condition through the status subresource, as a kubelet would.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from dpserve.operator.builders import SPEC_HASH
from tests.cluster.controlplane import ControlPlane
from tests.polling import eventually
from tests.workers import free_port

pytestmark = pytest.mark.cluster
REPO = Path(__file__).resolve().parents[2]
NS = "op-test"


@pytest.fixture(scope="module")
def cluster(control_plane: ControlPlane) -> ControlPlane:
    plane = control_plane
    plane.kubectl("apply", "-f", str(REPO / "charts/dpserve/crds"))
    plane.kubectl("wait", "--for=condition=Established", "crd/diffusionservices.dpserve.dev")
    plane.kubectl("create", "namespace", NS)
    # Pods need the namespace's default service account (the controller-manager's work).
    eventually(
        lambda: plane.kubectl("-n", NS, "get", "sa", "default", check=False).returncode == 0,
        what="default service account",
    )
    return plane


@pytest.fixture(scope="module")
def operator(cluster: ControlPlane) -> Iterator[subprocess.Popen[bytes]]:
    env = {**os.environ, "KUBECONFIG": str(cluster.kubeconfig)}
    env["DPSERVE_WORKER_IMAGE"] = "example.invalid/dpserve-worker:test"
    env["DPSERVE_ROUTER_IMAGE"] = "example.invalid/dpserve-router:test"
    cmd = [sys.executable, "-m", "dpserve", "operator", "--namespace", NS]
    proc = subprocess.Popen([*cmd, "--liveness-port", str(free_port())], env=env)
    try:
        yield proc
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def get(cluster: ControlPlane, *what: str) -> Any:
    return json.loads(cluster.kubectl("-n", NS, "get", *what, "-o", "json").stdout)


def apply(cluster: ControlPlane, manifest: dict[str, Any], check: bool = True) -> Any:
    return cluster.kubectl("apply", "-f", "-", input=json.dumps(manifest), check=check)


def dsvc(name: str, **spec: Any) -> dict[str, Any]:
    body = {"model": {"path": "/models/tiny"}, "device": "cpu", **spec}
    return {
        "apiVersion": "dpserve.dev/v1alpha1",
        "kind": "DiffusionService",
        "metadata": {"name": name, "namespace": NS},
        "spec": body,
    }


def pods(cluster: ControlPlane, name: str) -> dict[str, dict[str, Any]]:
    selector = f"app.kubernetes.io/instance={name},app.kubernetes.io/component=replica"
    listed = get(cluster, "pods", "-l", selector)
    return {p["metadata"]["name"]: p for p in listed["items"]}


def mark_ready(cluster: ControlPlane, pod: str) -> None:
    """The kubelet's part: report the pod Running and Ready."""
    now = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    status = {
        "phase": "Running",
        "conditions": [{"type": "Ready", "status": "True", "lastTransitionTime": now}],
    }
    cluster.kubectl(
        "-n",
        NS,
        "patch",
        "pod",
        pod,
        "--subresource=status",
        "--type=merge",
        "-p",
        json.dumps({"status": status}),
    )


def status(cluster: ControlPlane, name: str) -> dict[str, Any]:
    return get(cluster, "dsvc", name).get("status") or {}


def condition(cluster: ControlPlane, name: str, kind: str) -> dict[str, Any]:
    return next(c for c in status(cluster, name)["conditions"] if c["type"] == kind)


def test_crd_rejects_invalid_specs_with_the_cel_message(cluster: ControlPlane) -> None:
    role = apply(cluster, dsvc("bad-role", role="denoiser", replicas=2), check=False)
    assert role.returncode != 0
    assert "data-parallel replicas need role monolithic" in role.stderr
    sp = apply(cluster, dsvc("bad-sp", parallelism={"sp": 2, "ulysses": 2, "ring": 2}), False)
    assert sp.returncode != 0
    assert "parallelism.ulysses * parallelism.ring must equal parallelism.sp" in sp.stderr
    typed = apply(cluster, dsvc("bad-type", replicas="two"), check=False)
    assert typed.returncode != 0 and "replicas" in typed.stderr


def test_children_status_scale_roll_and_cascade(
    cluster: ControlPlane, operator: subprocess.Popen[bytes]
) -> None:
    apply(cluster, dsvc("tiny", replicas=2))
    eventually(
        lambda: set(pods(cluster, "tiny")) == {"tiny-replica-0", "tiny-replica-1"},
        what="two replica pods",
    )
    for kind, name in [
        ("service", "tiny-replicas"),
        ("service", "tiny"),
        ("deployment", "tiny-router"),
        ("serviceaccount", "tiny-router"),
        ("role", "tiny-router"),
        ("rolebinding", "tiny-router"),
        ("configmap", "tiny-control-log"),
    ]:
        obj = get(cluster, kind, name)
        assert obj["metadata"]["ownerReferences"][0]["kind"] == "DiffusionService"
    assert get(cluster, "service", "tiny-replicas")["spec"]["clusterIP"] == "None"

    # No node can take the pods: the scheduler's reason shows as Degraded.
    degraded = eventually(
        lambda: (
            condition(cluster, "tiny", "Degraded")["status"] == "True"
            and condition(cluster, "tiny", "Degraded")
        ),
        what="Degraded",
    )
    assert degraded["reason"] == "Unschedulable"
    assert "no nodes available to schedule pods" in degraded["message"]
    first = status(cluster, "tiny")
    assert first["replicas"] == 2 and first["readyReplicas"] == 0
    assert first["observedGeneration"] == get(cluster, "dsvc", "tiny")["metadata"]["generation"]

    for pod in pods(cluster, "tiny"):
        mark_ready(cluster, pod)
    eventually(lambda: status(cluster, "tiny").get("readyReplicas") == 2, what="2 ready")
    assert condition(cluster, "tiny", "Ready")["status"] == "True"
    columns = cluster.kubectl("-n", NS, "get", "dsvc", "tiny").stdout.split("\n")[0].split()
    assert columns == ["NAME", "READY", "REPLICAS", "PARALLEL", "AGE"]

    # A lost pod comes back under the same name.
    uid = pods(cluster, "tiny")["tiny-replica-1"]["metadata"]["uid"]
    cluster.kubectl("-n", NS, "delete", "pod", "tiny-replica-1", "--wait=false")
    eventually(
        lambda: pods(cluster, "tiny")["tiny-replica-1"]["metadata"]["uid"] != uid,
        what="tiny-replica-1 recreated",
    )
    mark_ready(cluster, "tiny-replica-1")

    # The scale subresource: kubectl scale (and an HPA) work on the CR.
    cluster.kubectl("-n", NS, "scale", "dsvc/tiny", "--replicas=3")
    eventually(lambda: "tiny-replica-2" in pods(cluster, "tiny"), what="third replica")
    cluster.kubectl("-n", NS, "scale", "dsvc/tiny", "--replicas=1")
    eventually(lambda: set(pods(cluster, "tiny")) == {"tiny-replica-0"}, what="scale to 1")
    eventually(lambda: status(cluster, "tiny").get("replicas") == 1, what="status follows")

    # A spec change replaces the replica; status tells the truth throughout.
    cluster.kubectl("-n", NS, "scale", "dsvc/tiny", "--replicas=2")
    eventually(lambda: len(pods(cluster, "tiny")) == 2, what="back to 2")
    for pod in pods(cluster, "tiny"):
        mark_ready(cluster, pod)
    eventually(lambda: status(cluster, "tiny").get("readyReplicas") == 2, what="2 ready again")
    old_hash = pods(cluster, "tiny")["tiny-replica-0"]["metadata"]["annotations"][SPEC_HASH]
    cluster.kubectl(
        "-n",
        NS,
        "patch",
        "dsvc",
        "tiny",
        "--type=merge",
        "-p",
        json.dumps({"spec": {"env": [{"name": "A", "value": "1"}]}}),
    )
    generation = get(cluster, "dsvc", "tiny")["metadata"]["generation"]
    seen_unavailable = 0
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline:
        current = pods(cluster, "tiny")
        hashes = {n: p["metadata"]["annotations"][SPEC_HASH] for n, p in current.items()}
        ready = [
            n
            for n, p in current.items()
            if any(
                c["type"] == "Ready" and c["status"] == "True"
                for c in p.get("status", {}).get("conditions") or []
            )
        ]
        seen_unavailable = max(seen_unavailable, 2 - len(ready))
        for name, pod_hash in hashes.items():
            if pod_hash != old_hash and name not in ready:
                mark_ready(cluster, name)  # the replacement came up
        st = status(cluster, "tiny")
        if (
            all(h != old_hash for h in hashes.values())
            and len(ready) == 2
            and (st.get("updatedReplicas") == 2 and st.get("observedGeneration") == generation)
        ):
            break
        time.sleep(0.2)
    else:
        raise AssertionError(f"roll did not finish: {status(cluster, 'tiny')}")
    assert seen_unavailable <= 1  # maxUnavailable 1: one replica at a time
    assert condition(cluster, "tiny", "Progressing")["status"] == "False"

    # No finalizer: deleting a CR never hangs on the operator being up.
    assert not get(cluster, "dsvc", "tiny")["metadata"].get("finalizers")
    # Deleting the CR deletes its children (owner references, garbage collector).
    cluster.kubectl("-n", NS, "delete", "dsvc", "tiny")
    eventually(lambda: not pods(cluster, "tiny"), what="pods collected")
    eventually(
        lambda: (
            cluster.kubectl("-n", NS, "get", "deployment", "tiny-router", check=False).returncode
            != 0
        ),
        what="router collected",
    )
    assert operator.poll() is None


def test_invalid_spec_beyond_the_crd_is_reported_not_crashed(
    cluster: ControlPlane, operator: subprocess.Popen[bytes]
) -> None:
    apply(cluster, dsvc("odd", model={"path": "models/tiny"}))
    degraded = eventually(
        lambda: (
            condition(cluster, "odd", "Degraded")["reason"] == "InvalidSpec"
            and condition(cluster, "odd", "Degraded")
        ),
        what="InvalidSpec",
    )
    assert "model.path must be absolute" in degraded["message"]
    events = get(cluster, "events", "--field-selector", "involvedObject.name=odd")["items"]
    assert any(e["reason"] == "InvalidSpec" for e in events)
    assert pods(cluster, "odd") == {}
    # Fixing the spec is picked up; the operator never stopped.
    apply(cluster, dsvc("odd", model={"path": "/models/tiny"}))
    eventually(lambda: len(pods(cluster, "odd")) == 1, what="replica after the fix")
    assert operator.poll() is None
