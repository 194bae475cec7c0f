"""The operator against a real kube-apiserver (with controller-manager and scheduler).

There is no kubelet here (the node-level e2e brings a test kubelet): pods stay
unbound, the real scheduler marks them Unschedulable, and where a journey needs
a Ready replica (or router) pod the test plays the kubelet's part by writing the
pod's phase, address and Ready condition through the status subresource, as a
kubelet would; the ReplicaSet and Deployment controllers then count a Ready
router pod as available.

The fault tests SIGKILL the operator in the middle of a scale and of a roll and
check that the restarted one converges: exactly the desired indices, each once,
owned by the CR, on the current spec, and a status that says so.
"""

from __future__ import annotations

import itertools
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from kubernetes import client as k8s
from kubernetes import config as k8s_config
from kubernetes import watch

from dpserve.operator import builders as b
from dpserve.operator.builders import SPEC_HASH
from dpserve.operator.spec import DiffusionServiceSpec
from tests.cluster.controlplane import ControlPlane
from tests.polling import eventually
from tests.workers import free_port

pytestmark = pytest.mark.cluster
REPO = Path(__file__).resolve().parents[2]
NS = "op-test"
NS_FAULTS = "op-faults"


@pytest.fixture(scope="module")
def cluster(control_plane: ControlPlane) -> ControlPlane:
    plane = control_plane
    plane.kubectl("apply", "-f", str(REPO / "charts/dpserve/crds"))
    plane.kubectl("wait", "--for=condition=Established", "crd/diffusionservices.dpserve.dev")
    for namespace in (NS, NS_FAULTS):
        plane.kubectl("create", "namespace", namespace)
        # Pods need the namespace's default service account (the controller-manager's work).
        eventually(
            lambda ns=namespace: (
                plane.kubectl("-n", ns, "get", "sa", "default", check=False).returncode == 0
            ),
            what="default service account",
        )
    return plane


class Operator:
    """``dpserve operator`` as a process of its own, to be killed and started again."""

    def __init__(self, cluster: ControlPlane, namespace: str) -> None:
        self.env = {**os.environ, "KUBECONFIG": str(cluster.kubeconfig)}
        self.env["DPSERVE_WORKER_IMAGE"] = "example.invalid/dpserve-worker:test"
        self.env["DPSERVE_ROUTER_IMAGE"] = "example.invalid/dpserve-router:test"
        # As the chart's allowHostPathModels=true: node-local caches are hostPath volumes.
        self.env["DPSERVE_ALLOW_HOSTPATH_MODELS"] = "true"
        self.cmd = [sys.executable, "-m", "dpserve", "operator", "--namespace", namespace]
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> Operator:
        port = str(free_port())
        self.proc = subprocess.Popen([*self.cmd, "--liveness-port", port], env=self.env)
        return self

    def kill(self) -> None:
        """SIGKILL: no cleanup handler runs, whatever it was doing stops half-way."""
        assert self.proc is not None
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(timeout=30)

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self) -> None:
        if self.alive():
            assert self.proc is not None
            self.proc.terminate()
            self.proc.wait(timeout=30)


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


def running(ip: str | None = None) -> dict[str, Any]:
    """The pod status a kubelet reports for a Running, Ready pod (at ``ip``)."""
    now = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    status: dict[str, Any] = {
        "phase": "Running",
        "conditions": [{"type": "Ready", "status": "True", "lastTransitionTime": now}],
    }
    if ip:
        status |= {"podIP": ip, "podIPs": [{"ip": ip}]}
    return status


def mark_ready(cluster: ControlPlane, pod: str, ip: str | None = None) -> None:
    """The kubelet's part: report the pod Running and Ready."""
    status = running(ip)
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


def mark_router_ready(cluster: ControlPlane, name: str) -> None:
    """Its ReplicaSet's pod reports Ready, so the Deployment counts it available."""
    selector = f"app.kubernetes.io/instance={name},app.kubernetes.io/component=router"
    routers = eventually(
        lambda: get(cluster, "pods", "-l", selector)["items"], what=f"{name}'s router pod"
    )
    for pod in routers:
        mark_ready(cluster, pod["metadata"]["name"])


def status(cluster: ControlPlane, name: str) -> dict[str, Any]:
    return get(cluster, "dsvc", name).get("status") or {}


def condition(cluster: ControlPlane, name: str, kind: str) -> dict[str, Any]:
    return next(c for c in status(cluster, name)["conditions"] if c["type"] == kind)


def events(cluster: ControlPlane, name: str, namespace: str = NS) -> list[tuple[str, str]]:
    """(reason, message) of the Events about DiffusionService ``name``, oldest first."""
    listed = json.loads(
        cluster.kubectl(
            "-n", namespace, "get", "events", "-o", "json",
            "--field-selector", f"involvedObject.kind=DiffusionService,involvedObject.name={name}",
        ).stdout
    )["items"]  # fmt: skip
    listed.sort(key=lambda e: (e.get("firstTimestamp") or "", e["metadata"]["name"]))
    return [(e["reason"], e["message"]) for e in listed]


def _handled(cluster: ControlPlane, name: str) -> str:
    """The spec and metadata the operator last handled (kopf's diff base), as stored."""
    annotations = get(cluster, "dsvc", name)["metadata"].get("annotations") or {}
    return str(annotations.get("dpserve.dev/last-handled-configuration", ""))


def has_event(cluster: ControlPlane, name: str, reason: str, pod: str) -> bool:
    return any(r == reason and pod in m for r, m in events(cluster, name))


def wait_event(cluster: ControlPlane, name: str, reason: str, pod: str) -> None:
    eventually(lambda: has_event(cluster, name, reason, pod), what=f"{reason} {pod}")


def test_crd_rejects_invalid_specs_with_the_cel_message(cluster: ControlPlane) -> None:
    role = apply(cluster, dsvc("bad-role", role="denoiser", replicas=2), check=False)
    assert role.returncode != 0
    assert "data-parallel replicas need role monolithic" in role.stderr
    alone = apply(cluster, dsvc("bad-role-alone", role="denoiser", replicas=1), check=False)
    assert alone.returncode != 0
    assert "disaggregated roles (encoder, denoiser, decoder) are not implemented" in alone.stderr
    sp = apply(cluster, dsvc("bad-sp", parallelism={"sp": 2, "ulysses": 2, "ring": 2}), False)
    assert sp.returncode != 0
    assert "parallelism.ulysses * parallelism.ring must equal parallelism.sp" in sp.stderr
    typed = apply(cluster, dsvc("bad-type", replicas="two"), check=False)
    assert typed.returncode != 0 and "replicas" in typed.stderr


def test_children_status_events_scale_roll_and_cascade(
    cluster: ControlPlane, operator: Operator
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
        ("configmap", "tiny-control-state"),
    ]:
        obj = get(cluster, kind, name)
        assert obj["metadata"]["ownerReferences"][0]["kind"] == "DiffusionService"
    assert get(cluster, "service", "tiny-replicas")["spec"]["clusterIP"] == "None"
    router_args = get(cluster, "deployment", "tiny-router")["spec"]["template"]["spec"]
    args = router_args["containers"][0]["args"]
    assert args[args.index("--control-state-configmap") + 1] == "tiny-control-state"
    assert get(cluster, "role", "tiny-router")["rules"][1]["resourceNames"] == [
        "tiny-control-state"
    ]
    # Each action is an Event on the DiffusionService (kubectl describe shows them).
    for pod in ("tiny-replica-0", "tiny-replica-1"):
        wait_event(cluster, "tiny", "ReplicaCreated", pod)

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
    # Every replica is Ready, but nothing serves before a router pod is available.
    not_yet = condition(cluster, "tiny", "Ready")
    assert (not_yet["status"], not_yet["reason"]) == ("False", "RouterNotAvailable")
    mark_router_ready(cluster, "tiny")
    eventually(lambda: condition(cluster, "tiny", "Ready")["status"] == "True", what="Ready")
    assert condition(cluster, "tiny", "Ready")["reason"] == "AllReplicasReady"
    wait = cluster.kubectl(
        "-n", NS, "wait", "--for=condition=Ready", "dsvc/tiny", "--timeout=5s", check=False
    )
    assert wait.returncode == 0, wait.stderr
    table = cluster.kubectl("-n", NS, "get", "dsvc", "tiny").stdout.splitlines()
    assert table[0].split() == ["NAME", "READY", "REPLICAS", "PARALLEL", "MODEL", "AGE"]
    row = table[1].split()
    assert row[:4] == ["tiny", "True", "2/2", "tp1-sp1-cfg1"]
    assert len(row) == 5  # MODEL is empty: nothing to fetch for a model.path

    # A lost pod comes back under the same name.
    uid = pods(cluster, "tiny")["tiny-replica-1"]["metadata"]["uid"]
    cluster.kubectl("-n", NS, "delete", "pod", "tiny-replica-1", "--wait=false")
    eventually(
        lambda: pods(cluster, "tiny")["tiny-replica-1"]["metadata"]["uid"] != uid,
        what="tiny-replica-1 recreated",
    )
    mark_ready(cluster, "tiny-replica-1")
    wait_event(cluster, "tiny", "ReplicaReplaced", "tiny-replica-1")

    # The scale subresource: kubectl scale (and an HPA) work on the CR.
    cluster.kubectl("-n", NS, "scale", "dsvc/tiny", "--replicas=3")
    eventually(lambda: "tiny-replica-2" in pods(cluster, "tiny"), what="third replica")
    cluster.kubectl("-n", NS, "scale", "dsvc/tiny", "--replicas=1")
    eventually(lambda: set(pods(cluster, "tiny")) == {"tiny-replica-0"}, what="scale to 1")
    eventually(lambda: status(cluster, "tiny").get("replicas") == 1, what="status follows")
    assert has_event(cluster, "tiny", "ReplicaCreated", "tiny-replica-2")
    for pod in ("tiny-replica-2", "tiny-replica-1"):
        wait_event(cluster, "tiny", "ReplicaDeleted", pod)

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
    for pod in ("tiny-replica-0", "tiny-replica-1"):
        assert has_event(cluster, "tiny", "ReplicaRolled", pod)
        assert has_event(cluster, "tiny", "ReplicaReplaced", pod)

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
    assert operator.alive()


def test_invalid_spec_beyond_the_crd_is_reported_not_crashed(
    cluster: ControlPlane, operator: Operator
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
    refused = eventually(
        lambda: [m for r, m in events(cluster, "odd") if r == "SpecRefused"], what="SpecRefused"
    )
    assert "model.path must be absolute" in refused[0]
    assert pods(cluster, "odd") == {}
    # Another reconcile of the same wrong spec (an edit kopf reacts to) records nothing new.
    cluster.kubectl("-n", NS, "annotate", "dsvc", "odd", "example.com/touched=1")
    # kopf stores what it handled once the handler has returned: this reconcile, and
    # any event it recorded, are done by the time the stored copy shows the edit.
    eventually(lambda: "example.com/touched" in _handled(cluster, "odd"), what="the edit handled")
    assert len([r for r, _ in events(cluster, "odd") if r == "SpecRefused"]) == 1
    # Fixing the spec is picked up; the operator never stopped.
    apply(cluster, dsvc("odd", model={"path": "/models/tiny"}))
    eventually(lambda: len(pods(cluster, "odd")) == 1, what="replica after the fix")
    assert has_event(cluster, "odd", "ReplicaCreated", "odd-replica-0")
    assert operator.alive()


def test_a_planted_wire_secret_is_refused_until_it_is_deleted(
    cluster: ControlPlane, operator: Operator
) -> None:
    """Someone who may create Secrets in the namespace makes ``<svc>-wire`` (a key they
    know) before the service: the operator, which cannot read Secrets, did not create
    it, so it is reported and nothing mounts it; deleting it lets the service start."""
    planted = {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": {"name": "planted-wire", "namespace": NS},
        "stringData": {b.WIRE_KEY: "a key someone else knows"},
    }
    apply(cluster, planted)
    apply(cluster, dsvc("planted"))
    degraded = eventually(
        lambda: (
            condition(cluster, "planted", "Degraded")["reason"] == "WireSecretNotOwned"
            and condition(cluster, "planted", "Degraded")
        ),
        what="WireSecretNotOwned",
    )
    assert f"kubectl -n {NS} delete secret planted-wire" in degraded["message"]
    assert [r for r, _ in events(cluster, "planted") if r == "WireSecretNotOwned"]
    assert pods(cluster, "planted") == {}
    assert "wireSecret" not in status(cluster, "planted")
    cluster.kubectl("-n", NS, "delete", "secret", "planted-wire")
    eventually(lambda: len(pods(cluster, "planted")) == 1, what="replica after the delete")
    assert status(cluster, "planted")["wireSecret"] == "planted-wire"
    owners = get(cluster, "secret", "planted-wire")["metadata"]["ownerReferences"]
    assert owners[0]["name"] == "planted" and owners[0]["kind"] == "DiffusionService"
    assert operator.alive()
    cluster.kubectl("-n", NS, "delete", "dsvc", "planted", "--wait=false")


def test_replicas_out_of_sync_are_reported_from_the_control_state(
    cluster: ControlPlane, operator: Operator
) -> None:
    apply(cluster, dsvc("synced", replicas=2))
    eventually(lambda: len(pods(cluster, "synced")) == 2, what="two replica pods")
    ips = {"synced-replica-0": "10.244.7.10", "synced-replica-1": "10.244.7.11"}
    for pod, ip in ips.items():
        mark_ready(cluster, pod, ip)
    mark_router_ready(cluster, "synced")
    eventually(lambda: condition(cluster, "synced", "Ready")["status"] == "True", what="Ready")
    assert condition(cluster, "synced", "ControlStateSynced")["reason"] == "InSync"

    def write(replicas: str) -> None:
        patch = {"data": {"replicas": replicas}}
        cluster.kubectl(
            "-n", NS, "patch", "configmap", "synced-control-state", "--type=merge",
            "-p", json.dumps(patch),
        )  # fmt: skip

    # What a router writes when a replica lacks the desired state.
    lagging = {"reason": "weights update failed", "since": time.time(), "router": "synced-r-1"}
    write(json.dumps({"tcp://10.244.7.11:5575": lagging}))
    synced = eventually(
        lambda: (
            condition(cluster, "synced", "ControlStateSynced")["status"] == "False"
            and condition(cluster, "synced", "ControlStateSynced")
        ),
        what="ControlStateSynced False",
    )
    assert synced["reason"] == "OutOfSync"
    assert synced["message"].startswith("replica 1: weights update failed (router synced-r-1")
    st = status(cluster, "synced")
    one = st["replicaStatuses"][1]
    assert (one["pod"], one["reason"], one["ready"]) == ("synced-replica-1", "OutOfSync", False)
    assert "weights update failed" in one["message"]
    assert st["readyReplicas"] == 1 and st["ready"] == "1/2"
    assert condition(cluster, "synced", "Ready")["status"] == "False"

    # A malformed write is ignored (and said so), never fatal.
    write("{not json")
    eventually(
        lambda: condition(cluster, "synced", "ControlStateSynced")["status"] == "Unknown",
        what="ControlStateSynced Unknown",
    )
    assert condition(cluster, "synced", "Ready")["status"] == "True"
    write("{}")
    eventually(
        lambda: condition(cluster, "synced", "ControlStateSynced")["status"] == "True",
        what="in sync again",
    )
    assert status(cluster, "synced")["readyReplicas"] == 2
    assert operator.alive()
    cluster.kubectl("-n", NS, "delete", "dsvc", "synced", "--wait=false")


# ------------------------------------------------------------ operator faults


class Kubelet:
    """Plays the kubelet for every dpserve pod in a namespace, from a thread: each pod
    that is not Ready gets an address and, ``startup_s`` after it was first seen,
    reports Running and Ready. It also records,
    per service, the most replica pods (not terminating) it ever saw at once, any index
    held by two pods, and, once ``watch_floor`` names the service, the fewest Ready."""

    def __init__(self, api: k8s.ApiClient, namespace: str, startup_s: float = 0.0) -> None:
        self.core = k8s.CoreV1Api(api)
        self.namespace = namespace
        self.startup_s = startup_s
        self._seen: dict[str, float] = {}
        self.most: Counter[str] = Counter()
        self.duplicates: list[str] = []
        self.fewest_ready: dict[str, int] = {}
        self.paused = threading.Event()
        self._ips: dict[str, str] = {}
        self._next = itertools.count(10)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="fake-kubelet", daemon=True)

    def watch_floor(self, name: str, ready_now: int) -> None:
        self.fewest_ready[name] = ready_now

    def __enter__(self) -> Kubelet:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=10)

    def _run(self) -> None:
        while not self._stop.wait(0.2):
            try:
                self._round()
            except Exception:  # an API hiccup; the next round retries
                continue

    def _round(self) -> None:
        listed = self.core.list_namespaced_pod(
            self.namespace, label_selector="app.kubernetes.io/name=dpserve"
        ).items
        live = [p for p in listed if p.metadata.deletion_timestamp is None]
        replicas = [p for p in live if p.metadata.labels.get(b.REPLICA_LABEL) is not None]
        per_service = Counter(p.metadata.labels["app.kubernetes.io/instance"] for p in replicas)
        for name, count in per_service.items():
            self.most[name] = max(self.most[name], count)
        slots = Counter(
            (p.metadata.labels["app.kubernetes.io/instance"], p.metadata.labels[b.REPLICA_LABEL])
            for p in replicas
        )
        self.duplicates += [f"{svc}/{index}" for (svc, index), n in slots.items() if n > 1]
        for name, fewest in self.fewest_ready.items():
            ready = sum(
                1
                for p in replicas
                if p.metadata.labels["app.kubernetes.io/instance"] == name
                and any(c.type == "Ready" and c.status == "True" for c in p.status.conditions or [])
            )
            self.fewest_ready[name] = min(fewest, ready)
        if self.paused.is_set():
            return
        for pod in live:
            conditions = (pod.status.conditions if pod.status else None) or []
            if any(c.type == "Ready" and c.status == "True" for c in conditions):
                continue
            first_seen = self._seen.setdefault(pod.metadata.uid, time.monotonic())
            if time.monotonic() - first_seen < self.startup_s:
                continue  # still "loading the model"
            ip = self._ips.setdefault(pod.metadata.uid, f"10.244.9.{next(self._next)}")
            self.core.patch_namespaced_pod_status(
                pod.metadata.name,
                self.namespace,
                {"status": running(ip)},
                _content_type="application/strategic-merge-patch+json",
            )


@pytest.fixture(scope="module")
def api(cluster: ControlPlane) -> k8s.ApiClient:
    return k8s_config.new_client_from_config(config_file=str(cluster.kubeconfig))


@pytest.fixture
def faulty(cluster: ControlPlane) -> Iterator[Operator]:
    op = Operator(cluster, NS_FAULTS).start()
    try:
        yield op
    finally:
        op.stop()


def kill_when(
    operator: Operator,
    api: k8s.ApiClient,
    name: str,
    trigger: Callable[[str, Any], bool],
    act: Callable[[], object] = lambda: None,
) -> list[str]:
    """Do ``act``, then SIGKILL the operator on the first replica pod event (type, pod)
    for which ``trigger`` holds: it is then in the middle of what ``act`` started.
    Returns the replica pods that exist right after the kill."""
    core = k8s.CoreV1Api(api)
    selector = f"app.kubernetes.io/instance={name},app.kubernetes.io/component=replica"
    since = core.list_namespaced_pod(NS_FAULTS, label_selector=selector).metadata.resource_version
    act()
    stream = watch.Watch()
    for event in stream.stream(
        core.list_namespaced_pod,
        NS_FAULTS,
        label_selector=selector,
        resource_version=since,
        timeout_seconds=60,
    ):
        if trigger(event["type"], event["object"]):
            operator.kill()
            stream.stop()
            break
    else:
        raise AssertionError(f"{name}: the operator never got there")
    left = core.list_namespaced_pod(NS_FAULTS, label_selector=selector).items
    return sorted(p.metadata.name for p in left if p.metadata.deletion_timestamp is None)


def converged(cluster: ControlPlane, name: str) -> bool:
    """Exactly the desired replicas, each once, owned by the CR, on its current spec,
    all Ready, the router available, and a status that says all of that."""
    obj = json.loads(cluster.kubectl("-n", NS_FAULTS, "get", "dsvc", name, "-o", "json").stdout)
    replicas, current = (
        obj["spec"]["replicas"],
        b.spec_hash(DiffusionServiceSpec.model_validate(obj["spec"])),
    )
    selector = f"app.kubernetes.io/instance={name},app.kubernetes.io/component=replica"
    listed = json.loads(
        cluster.kubectl("-n", NS_FAULTS, "get", "pods", "-l", selector, "-o", "json").stdout
    )["items"]
    indices = sorted(int(p["metadata"]["labels"][b.REPLICA_LABEL]) for p in listed)
    if indices != list(range(replicas)):
        return False
    for pod in listed:
        meta = pod["metadata"]
        index = meta["labels"][b.REPLICA_LABEL]
        assert meta["name"] == f"{name}-replica-{index}"
        [owner] = meta["ownerReferences"]
        assert (owner["kind"], owner["uid"], owner["controller"]) == (
            "DiffusionService",
            obj["metadata"]["uid"],
            True,
        )
        ready = any(
            c["type"] == "Ready" and c["status"] == "True"
            for c in pod.get("status", {}).get("conditions") or []
        )
        if meta.get("deletionTimestamp") or meta["annotations"][SPEC_HASH] != current or not ready:
            return False
    st = obj.get("status") or {}
    conditions = {c["type"]: c for c in st.get("conditions") or []}
    return (
        st.get("observedGeneration") == obj["metadata"]["generation"]
        and (st.get("replicas"), st.get("readyReplicas"), st.get("updatedReplicas"))
        == (replicas, replicas, replicas)
        and [(r["index"], r["pod"], r["ready"], r["updated"]) for r in st["replicaStatuses"]]
        == [(i, f"{name}-replica-{i}", True, True) for i in range(replicas)]
        and conditions["Ready"]["status"] == "True"
        and conditions["Progressing"]["status"] == "False"
    )


def fault_svc(name: str, **spec: Any) -> dict[str, Any]:
    return {**dsvc(name, **spec), "metadata": {"name": name, "namespace": NS_FAULTS}}


def test_operator_killed_mid_scale_converges_on_restart(
    cluster: ControlPlane, api: k8s.ApiClient, faulty: Operator
) -> None:
    scale = ["-n", NS_FAULTS, "scale", "dsvc/scaler"]
    with Kubelet(api, NS_FAULTS) as kubelet:
        apply(cluster, fault_svc("scaler", replicas=1))
        eventually(lambda: converged(cluster, "scaler"), what="1 replica")

        # Killed once the first new pod exists: the rest of the scale-up is not done.
        left = kill_when(
            faulty,
            api,
            "scaler",
            lambda kind, pod: kind == "ADDED" and pod.metadata.name != "scaler-replica-0",
            act=lambda: cluster.kubectl(*scale, "--replicas=8"),
        )
        print(f"killed mid scale-up with {len(left)} of 8 pods")
        faulty.start()
        eventually(lambda: converged(cluster, "scaler"), 90, "8 replicas after the restart")

        # Killed at the first deletion of a scale-down; scaled again while it is down.
        left = kill_when(
            faulty,
            api,
            "scaler",
            lambda kind, pod: kind == "DELETED",
            act=lambda: cluster.kubectl(*scale, "--replicas=2"),
        )
        print(f"killed mid scale-down with {len(left)} pods left")
        cluster.kubectl(*scale, "--replicas=3")
        faulty.start()
        eventually(lambda: converged(cluster, "scaler"), 90, "3 replicas after the restart")
    assert kubelet.duplicates == []
    assert kubelet.most["scaler"] <= 8
    for reason in ("ReplicaCreated", "ReplicaDeleted"):
        assert any(r == reason for r, _ in events(cluster, "scaler", NS_FAULTS))
    assert faulty.alive()


def test_operator_killed_mid_roll_converges_on_restart(
    cluster: ControlPlane, api: k8s.ApiClient, faulty: Operator
) -> None:
    strategy = {"maxUnavailable": 1, "maxSurge": 1}
    # Replacements take a moment to turn Ready, as a model server's do.
    with Kubelet(api, NS_FAULTS, startup_s=1.5) as kubelet:
        apply(cluster, fault_svc("roller", replicas=3, updateStrategy=strategy))
        eventually(lambda: converged(cluster, "roller"), 90, "3 replicas")
        old = {p["metadata"]["annotations"][SPEC_HASH] for p in pods_in(cluster, "roller")}
        kubelet.watch_floor("roller", 3)
        patch = {"spec": {"env": [{"name": "ROLL", "value": "1"}]}}

        def change_spec() -> None:
            cluster.kubectl(
                "-n", NS_FAULTS, "patch", "dsvc", "roller", "--type=merge",
                "-p", json.dumps(patch),
            )  # fmt: skip

        # Killed at the roll's first deletion (its surge pod may or may not exist yet).
        kill_when(faulty, api, "roller", lambda kind, _: kind == "DELETED", act=change_spec)
        faulty.start()

        # Killed again at the first pod it creates on the new spec after the restart.
        def on_new_spec(kind: str, pod: Any) -> bool:
            return kind == "ADDED" and pod.metadata.annotations[SPEC_HASH] not in old

        kill_when(faulty, api, "roller", on_new_spec)
        # While it is down the kubelet carries on: the pod it created turns Ready.
        eventually(lambda: _new_ready(cluster, "roller", old), 30, "the new pod Ready")
        faulty.start()
        eventually(lambda: converged(cluster, "roller"), 120, "the roll after two restarts")
    assert kubelet.duplicates == []
    assert kubelet.most["roller"] <= 3 + 1  # never more than replicas + maxSurge
    assert kubelet.fewest_ready["roller"] >= 3 - 1  # never fewer than replicas - maxUnavailable
    reasons = {r for r, _ in events(cluster, "roller", NS_FAULTS)}
    assert {"ReplicaRolled", "ReplicaReplaced"} <= reasons
    assert faulty.alive()


def _new_ready(cluster: ControlPlane, name: str, old_hashes: set[str]) -> bool:
    """A replica pod of a spec other than ``old_hashes`` is Ready."""
    return any(
        pod["metadata"]["annotations"][SPEC_HASH] not in old_hashes
        and any(
            c["type"] == "Ready" and c["status"] == "True"
            for c in (pod.get("status") or {}).get("conditions") or []
        )
        for pod in pods_in(cluster, name)
    )


def pods_in(cluster: ControlPlane, name: str) -> list[dict[str, Any]]:
    selector = f"app.kubernetes.io/instance={name},app.kubernetes.io/component=replica"
    out = cluster.kubectl("-n", NS_FAULTS, "get", "pods", "-l", selector, "-o", "json").stdout
    return list(json.loads(out)["items"])


FETCHED_MODEL = {
    "source": "s3://models/tiny/",
    "credentials": {"secretName": "store"},
    "cache": {"claimName": "model-cache"},
}
V1 = "/models/entries/s3-models-tiny/listing-1/model"
V2 = "/models/entries/s3-models-tiny-v2/listing-2/model"


def fill_jobs(cluster: ControlPlane, name: str) -> dict[str, dict[str, Any]]:
    selector = f"app.kubernetes.io/instance={name},app.kubernetes.io/component=model-fill"
    return {j["metadata"]["name"]: j for j in get(cluster, "jobs", "-l", selector)["items"]}


def end_fill_pod(cluster: ControlPlane, job: str, outcome: dict[str, Any], code: int) -> None:
    """The kubelet's part for a fill pod: its container ended with ``code``, leaving
    ``outcome`` as its termination message (what ``dpserve fetch --result-file`` writes)."""
    found = eventually(
        lambda: get(cluster, "pods", "-l", f"dpserve.dev/fill-job={job}")["items"],
        what=f"{job}'s pod",
    )
    now = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    terminated = {
        "exitCode": code,
        "reason": "Completed" if code == 0 else "Error",
        "message": json.dumps(outcome),
        "startedAt": now,
        "finishedAt": now,
    }
    container = {
        "name": "fetch", "image": "dpserve-worker", "imageID": "", "ready": False,
        "restartCount": 0, "state": {"terminated": terminated},
    }  # fmt: skip
    status = {"phase": "Succeeded" if code == 0 else "Failed", "containerStatuses": [container]}
    cluster.kubectl(
        "-n", NS, "patch", "pod", found[0]["metadata"]["name"], "--subresource=status",
        "--type=merge", "-p", json.dumps({"status": status}),
    )  # fmt: skip


def model_args(pod: dict[str, Any]) -> str:
    args = pod["spec"]["containers"][0]["args"]
    return str(args[args.index("--model") + 1])


def test_a_model_source_is_fetched_by_one_job_then_loaded_by_every_replica(
    cluster: ControlPlane, operator: Operator
) -> None:
    """The Job controller, the podFailurePolicy and the garbage collector are the real
    ones; the test plays the kubelet for the fill pods, as for the replicas."""
    refused = apply(cluster, dsvc("no-cache", model={"source": "s3://models/tiny/"}), False)
    assert refused.returncode != 0 and "needs model.cache: claimName" in refused.stderr
    both = apply(cluster, dsvc("both", model={**FETCHED_MODEL, "path": "/m"}), check=False)
    assert both.returncode != 0 and "exactly one of path" in both.stderr

    apply(cluster, dsvc("fetched", replicas=2, model=FETCHED_MODEL))
    (job,) = eventually(lambda: list(fill_jobs(cluster, "fetched")), what="the fill Job")
    spec = fill_jobs(cluster, "fetched")[job]["spec"]["template"]["spec"]["containers"][0]
    assert spec["args"][:2] == ["fetch", "s3://models/tiny/"]
    assert spec["envFrom"] == [{"secretRef": {"name": "store"}}]
    eventually(lambda: has_event(cluster, "fetched", "FetchStarted", job), what="FetchStarted")
    # Held back: no replica pod asks for a GPU while its model is on the way.
    waiting = eventually(
        lambda: (st := status(cluster, "fetched")).get("replicaStatuses") and st,
        what="status",
    )
    assert [r["phase"] for r in waiting["replicaStatuses"]] == ["WaitingForModel"] * 2
    assert waiting["model"]["fetch"]["state"] == "Pending" and not pods(cluster, "fetched")
    assert condition(cluster, "fetched", "Ready")["reason"] == "WaitingForModel"
    table = cluster.kubectl("-n", NS, "get", "dsvc", "fetched").stdout.splitlines()
    assert table[0].split() == ["NAME", "READY", "REPLICAS", "PARALLEL", "MODEL", "AGE"]
    assert table[1].split()[4] == "Pending"

    ready = {"state": "ready", "revision": "listing-1", "folder": V1, "bytes_total": 5}
    end_fill_pod(cluster, job, ready, 0)
    eventually(lambda: len(pods(cluster, "fetched")) == 2, what="replicas made once fetched")
    for pod in pods(cluster, "fetched").values():
        assert model_args(pod) == V1
        volume = next(v for v in pod["spec"]["volumes"] if v["name"] == "model")
        assert volume["persistentVolumeClaim"] == {"claimName": "model-cache", "readOnly": True}
        assert "envFrom" not in pod["spec"]["containers"][0]
    model_ready = condition(cluster, "fetched", "ModelReady")
    assert (model_ready["status"], model_ready["reason"]) == ("True", "Fetched")
    loaded = status(cluster, "fetched")["model"]
    assert loaded["loaded"]["revision"] == "listing-1" and "fetch" not in loaded
    assert any(r == "FetchFinished" and "listing-1" in m for r, m in events(cluster, "fetched"))

    # A new source: a new Job, while the replicas stay on the old entry. Its refusal
    # (exit 3) fails the Job at once: no second pod.
    uids = {n: p["metadata"]["uid"] for n, p in pods(cluster, "fetched").items()}
    moved = {**FETCHED_MODEL, "source": "s3://models/tiny-v2/"}
    apply(cluster, dsvc("fetched", replicas=2, model=moved))
    (job2,) = eventually(
        lambda: [j for j in fill_jobs(cluster, "fetched") if j != job], what="the second Job"
    )
    error = "s3://models/tiny-v2/vae/x.safetensors: md5 is 12, the store says 34"
    end_fill_pod(cluster, job2, {"state": "failed", "error": error}, 3)
    failed = eventually(
        lambda: (c := condition(cluster, "fetched", "ModelReady"))["reason"] == "FetchFailed" and c,
        what="FetchFailed",
    )
    assert (
        error in failed["message"]
        and "replicas load s3://models/tiny/ meanwhile" in failed["message"]
    )
    assert fill_jobs(cluster, "fetched")[job2]["status"].get("failed") == 1
    assert any(r == "FetchFailed" and error in m for r, m in events(cluster, "fetched"))
    assert status(cluster, "fetched")["model"]["progress"] == "Failed"
    assert {n: p["metadata"]["uid"] for n, p in pods(cluster, "fetched").items()} == uids

    # Deleting the failed Job tries again; once fetched, the replicas roll onto it.
    cluster.kubectl("-n", NS, "delete", "job", job2)
    eventually(
        lambda: (
            fill_jobs(cluster, "fetched").get(job2, {}).get("status", {}).get("failed") is None
            and job2 in fill_jobs(cluster, "fetched")
        ),
        what="the Job made again",
    )
    end_fill_pod(cluster, job2, {**ready, "revision": "listing-2", "folder": V2}, 0)
    eventually(
        lambda: any(model_args(p) == V2 for p in pods(cluster, "fetched").values()),
        what="a replica rolled onto the new entry",
    )
    assert status(cluster, "fetched")["model"]["loaded"]["source"] == "s3://models/tiny-v2/"

    # Once every replica runs on it, one clean-up Job prunes the claim, sparing it.
    def rolled() -> bool:
        current = pods(cluster, "fetched")
        for name, pod in current.items():
            if model_args(pod) == V2 and pod.get("status", {}).get("phase") != "Running":
                mark_ready(cluster, name)
        return len(current) == 2 and all(model_args(p) == V2 for p in current.values())

    eventually(rolled, what="both replicas on the new entry")
    selector = "app.kubernetes.io/instance=fetched,app.kubernetes.io/component=model-prune"
    (prune,) = eventually(lambda: get(cluster, "jobs", "-l", selector)["items"], what="prune")
    args = prune["spec"]["template"]["spec"]["containers"][0]["args"]
    assert args[:5] == ["prune-cache", "--model-cache", "/models", "--keep", "1"]
    assert args[args.index("--protect") + 1] == V2
    eventually(lambda: status(cluster, "fetched")["model"].get("pruned") == V2, what="recorded")
    assert any(r == "CachePruning" for r, _ in events(cluster, "fetched"))

    cluster.kubectl("-n", NS, "delete", "dsvc", "fetched")
    eventually(lambda: not fill_jobs(cluster, "fetched"), what="fill Jobs collected")


COMMIT = "0123456789abcdef0123456789abcdef01234567"
HOST = "/var/lib/dpserve/models"
NODE_MODEL = {
    "source": "hf://org/tiny@main",
    "credentials": {"secretName": "store"},
    "cache": {"nodeLocal": {"path": HOST}},
}
HF_FOLDER = f"/models/hf/models--org--tiny/snapshots/{COMMIT}"


def set_fetch(cluster: ControlPlane, pod: str, state: dict[str, Any], **extra: Any) -> None:
    """The kubelet's part for a replica's fetch init container: its state now."""
    init = {"name": "fetch", "image": "dpserve-worker", "imageID": "", "ready": False,
            "restartCount": 0, "state": state, **extra}  # fmt: skip
    status = {"phase": "Pending", "initContainerStatuses": [init]}
    cluster.kubectl("-n", NS, "patch", "pod", pod, "--subresource=status", "--type=merge",
                    "-p", json.dumps({"status": status}))  # fmt: skip


def test_a_node_local_cache_is_pinned_by_one_job_then_fetched_by_each_replica(
    cluster: ControlPlane, operator: Operator
) -> None:
    """The pin Job, then replicas made at once, each with the init container that
    fetches the pinned commit into its node's folder; status follows those init
    containers (the test plays the kubelet, as for the fill pods)."""
    both = {**NODE_MODEL, "cache": {"nodeLocal": {"path": HOST}, "claimName": "c"}}
    refused = apply(cluster, dsvc("both-caches", model=both), check=False)
    assert refused.returncode != 0 and "exactly one of claimName" in refused.stderr

    apply(cluster, dsvc("nodes", replicas=2, model=NODE_MODEL))
    (job,) = eventually(lambda: list(fill_jobs(cluster, "nodes")), what="the pin Job")
    assert job.startswith("nodes-pin-")
    template = fill_jobs(cluster, "nodes")[job]["spec"]["template"]["spec"]
    assert template["containers"][0]["args"][:5] == [
        "fetch", "hf://org/tiny@main", "--model-cache", "/models", "--pin"]  # fmt: skip
    assert not any("hostPath" in v for v in template["volumes"])
    eventually(lambda: has_event(cluster, "nodes", "FetchStarted", job), what="FetchStarted")
    held = eventually(lambda: (st := status(cluster, "nodes")).get("replicaStatuses") and st,
                      what="status")  # fmt: skip
    assert [r["phase"] for r in held["replicaStatuses"]] == ["WaitingForModel"] * 2
    assert not pods(cluster, "nodes")

    pinned = {"state": "pinned", "revision": COMMIT, "folder": HF_FOLDER, "bytes_total": 5,
              "fetch": f"hf://org/tiny@{COMMIT}"}  # fmt: skip
    end_fill_pod(cluster, job, pinned, 0)
    made = eventually(lambda: len(pods(cluster, "nodes")) == 2 and pods(cluster, "nodes"),
                      what="replicas made once pinned")  # fmt: skip
    for pod in made.values():
        spec = pod["spec"]
        (init,) = spec["initContainers"]
        assert init["args"][:2] == ["fetch", f"hf://org/tiny@{COMMIT}"]
        assert init["args"][init["args"].index("--expect-revision") + 1] == COMMIT
        assert init["envFrom"] == [{"secretRef": {"name": "store"}}]
        assert "store" not in json.dumps(spec["containers"])
        assert model_args(pod) == HF_FOLDER
        volume = next(v for v in spec["volumes"] if v["name"] == "model")
        assert volume["hostPath"]["path"] == HOST
        mount = next(m for m in spec["containers"][0]["volumeMounts"] if m["name"] == "model")
        assert mount["readOnly"] is True
    assert status(cluster, "nodes")["model"]["loaded"]["nodeLocal"] == HOST
    assert any(r == "FetchPinned" and COMMIT in m for r, m in events(cluster, "nodes"))

    # Both fetch: phase FetchingModel, ModelReady not yet.
    now = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    for name in made:
        set_fetch(cluster, name, {"running": {"startedAt": now}})

    def phases() -> list[str]:
        return [r["phase"] for r in status(cluster, "nodes").get("replicaStatuses") or []]

    eventually(lambda: phases() == ["FetchingModel"] * 2, what="FetchingModel")
    model_ready = condition(cluster, "nodes", "ModelReady")
    assert model_ready["status"] == "False" and "0/2 replicas fetched" in model_ready["message"]
    assert status(cluster, "nodes")["model"]["fetch"]["pod"] in made

    # Replica 1's fetch is refused: FetchFailed names the file.
    error = f"hf://org/tiny@{COMMIT}: vae/x.safetensors: sha256 is 12, the hub says 34"
    refusal = {
        "exitCode": 3,
        "reason": "Error",
        "startedAt": now,
        "finishedAt": now,
        "message": json.dumps({"state": "failed", "error": error, "retried": False}),
    }
    set_fetch(cluster, "nodes-replica-1", {"waiting": {"reason": "CrashLoopBackOff"}},
              lastState={"terminated": refusal})  # fmt: skip
    failed = eventually(
        lambda: (c := condition(cluster, "nodes", "ModelReady"))["reason"] == "FetchFailed" and c,
        what="FetchFailed",
    )
    assert "nodes-replica-1" in failed["message"] and "vae/x.safetensors" in failed["message"]
    assert any(r == "FetchFailed" and error in m for r, m in events(cluster, "nodes"))

    # Both past their fetch (fixed, tried again): Fetched, and FetchFinished once.
    done = {"exitCode": 0, "reason": "Completed", "startedAt": now, "finishedAt": now}
    for name in made:
        set_fetch(cluster, name, {"terminated": done})
        mark_ready(cluster, name)
    eventually(lambda: condition(cluster, "nodes", "ModelReady")["reason"] == "Fetched",
               what="Fetched")  # fmt: skip
    assert "fetch" not in status(cluster, "nodes")["model"]
    eventually(lambda: has_event(cluster, "nodes", "FetchFinished", COMMIT), what="finished")

    # A new source: a new pin; the replicas roll onto it, one at a time.
    moved = {**NODE_MODEL, "source": "s3://models/tiny-v2/"}
    apply(cluster, dsvc("nodes", replicas=2, model=moved))
    (job2,) = eventually(lambda: [j for j in fill_jobs(cluster, "nodes") if j != job],
                         what="the second pin Job")  # fmt: skip
    end_fill_pod(cluster, job2, {"state": "pinned", "revision": "listing-2", "folder": V2}, 0)

    def rolled_one() -> bool:
        for pod in pods(cluster, "nodes").values():
            if model_args(pod) == V2:
                args = pod["spec"]["initContainers"][0]["args"]
                return args[1] == "s3://models/tiny-v2/" and "listing-2" in args
        return False

    eventually(rolled_one, what="a replica rolled onto the new pin")
    cluster.kubectl("-n", NS, "delete", "dsvc", "nodes")
    eventually(lambda: not fill_jobs(cluster, "nodes"), what="pin Jobs collected")
