"""The test kubelet against the real control plane: pods run, get real addresses, probe,
restart, authenticate as their service account, stop on SIGTERM; the scheduler's
resource accounting sees the node's capacity.

Every workload is created up front (module fixture) so their start-ups overlap; each
test then waits for the state of the world it checks.
"""

from __future__ import annotations

import ipaddress
import json
import textwrap
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import httpx
import pytest

from tests.cluster.kubelet import Api, ApiError, TestKubelet
from tests.cluster.localcluster import LocalCluster

pytestmark = pytest.mark.cluster

NS = "kubelet-test"
T = TypeVar("T")

LIST_PODS = textwrap.dedent(
    """
    import os, sys, time
    from kubernetes import client, config
    from kubernetes.client.rest import ApiException
    print("env", os.environ["KUBERNETES_SERVICE_HOST"], os.environ["KUBERNETES_SERVICE_PORT"],
          os.environ["MY_POD_NAME"], os.environ["MY_POD_IP"], os.environ["MY_SA"], flush=True)
    config.load_incluster_config()
    api = client.CoreV1Api()
    for attempt in range(int(os.environ.get("ATTEMPTS", "1"))):
        try:
            pods = api.list_namespaced_pod(os.environ["MY_NS"])
        except ApiException as e:
            print("status", e.status, e.reason, e.body, flush=True)
            if e.status != 403:
                sys.exit(4)
            time.sleep(1)
            continue
        print("listed", len(pods.items), flush=True)
        sys.exit(0)
    sys.exit(3)
    """
)

GRACEFUL = textwrap.dedent(
    """
    import pathlib, signal, sys, time
    out = pathlib.Path("/out")
    def stop(signum, frame):
        (out / "sigterm").write_text(str(signum))
        sys.exit(0)
    signal.signal(signal.SIGTERM, stop)
    (out / "started").write_text("yes")
    while True:
        time.sleep(0.1)
    """
)


FEATURES = """
cat /work/init.txt /work/sub/x /work/uid /config/file.txt; echo
echo "env $GREETING $PASSWORD $EXPANDED $0"
cat /podinfo/labels; echo
echo "hostname $(hostname) cwd $(pwd)"
test -e /var/run/secrets/kubernetes.io/serviceaccount/token || echo no-token
exec python -m http.server 9000 --bind 0.0.0.0
"""


RESTRICTED = """
import errno, os, pathlib, time
print("ids", os.getuid(), os.getgid(), sorted(os.getgroups()), flush=True)
try:
    open("/dpserve-rootfs-write-test", "w")
    print("root writable", flush=True)
except OSError as e:
    print("root", errno.errorcode[e.errno], flush=True)
pathlib.Path("/tmp/scratch").write_text("x")
print("tmp writable; secret", pathlib.Path("/secret/password").read_text(), flush=True)
while True:
    time.sleep(1)
"""


def restricted_pods() -> list[dict[str, Any]]:
    """What the restricted Pod Security Standard asks, honoured; and a root one refused."""
    return [
        pod_spec(
            "restricted",
            ["python", "-c", RESTRICTED],
            automountServiceAccountToken=False,
            securityContext={
                "runAsNonRoot": True,
                "runAsUser": 10001,
                "runAsGroup": 10001,
                "fsGroup": 10002,
            },
            volumes=[
                {"name": "tmp", "emptyDir": {}},
                # Readable through fsGroup only (group 10002, mode 0440).
                {"name": "secret", "secret": {"secretName": "features", "defaultMode": 0o440}},
            ],
            container={
                "securityContext": {"readOnlyRootFilesystem": True},
                "volumeMounts": [
                    {"name": "tmp", "mountPath": "/tmp"},
                    {"name": "secret", "mountPath": "/secret", "readOnly": True},
                ],
                "readinessProbe": {
                    "exec": {"command": ["sh", "-c", "test $(id -u) = 10001"]},
                    "periodSeconds": 1,
                },
            },
        ),
        pod_spec(
            "rootful",
            ["sleep", "600"],
            automountServiceAccountToken=False,
            securityContext={"runAsNonRoot": True},
        ),
    ]


def features_pod() -> list[dict[str, Any]]:
    """One pod using the rest of what the kubelet supports, and its ConfigMap and Secret."""
    sh = "test/shell"
    return [
        {
            "apiVersion": "v1",
            "kind": "ConfigMap",
            "metadata": {"name": "features"},
            "data": {"greeting": "hello", "file.txt": "from-configmap"},
        },
        {
            "apiVersion": "v1",
            "kind": "Secret",
            "metadata": {"name": "features"},
            "stringData": {"password": "s3cr3t"},
        },
        pod_spec(
            "features",
            ["sh", "-c", FEATURES, "$(GREETING)-arg"],
            automountServiceAccountToken=False,
            volumes=[
                {"name": "work", "emptyDir": {}},
                {"name": "scratch", "emptyDir": {}},
                {
                    "name": "config",
                    "configMap": {
                        "name": "features",
                        "items": [{"key": "file.txt", "path": "file.txt"}],
                    },
                },
                {
                    "name": "podinfo",
                    "downwardAPI": {
                        "items": [{"path": "labels", "fieldRef": {"fieldPath": "metadata.labels"}}]
                    },
                },
            ],
            initContainers=[
                {
                    "name": "init",
                    "image": sh,
                    "command": [
                        "sh",
                        "-c",
                        "echo init-ran > /work/init.txt; echo in-subpath > /sub/x",
                    ],
                    "volumeMounts": [
                        {"name": "work", "mountPath": "/work"},
                        {"name": "work", "mountPath": "/sub", "subPath": "sub"},
                    ],
                },
                {
                    "name": "whoami",
                    "image": sh,
                    "command": ["sh", "-c", "id -u > /work/uid"],
                    # Honoured: the process runs as that user (and the probes too).
                    "securityContext": {"runAsUser": 65534, "runAsGroup": 65534},
                    "volumeMounts": [{"name": "work", "mountPath": "/work"}],
                },
                {
                    "name": "sidecar",
                    "image": sh,
                    "restartPolicy": "Always",
                    "command": ["sleep", "600"],
                },
            ],
            container={
                "workingDir": "/work",
                "env": [
                    {
                        "name": "GREETING",
                        "valueFrom": {"configMapKeyRef": {"name": "features", "key": "greeting"}},
                    },
                    {
                        "name": "PASSWORD",
                        "valueFrom": {"secretKeyRef": {"name": "features", "key": "password"}},
                    },
                    {"name": "EXPANDED", "value": "$(GREETING)-world $$(GREETING)"},
                ],
                "volumeMounts": [
                    {"name": "work", "mountPath": "/work"},
                    {"name": "config", "mountPath": "/config"},
                    {"name": "podinfo", "mountPath": "/podinfo"},
                    # Over the kubelet's own dir (in /tmp): later mounts must still work.
                    {"name": "scratch", "mountPath": "/tmp"},
                ],
                "startupProbe": {
                    "tcpSocket": {"port": 9000},
                    "periodSeconds": 1,
                    "failureThreshold": 30,
                },
                "readinessProbe": {
                    "exec": {"command": ["cat", "/work/init.txt"]},
                    "periodSeconds": 1,
                },
            },
        ),
    ]


def wait_for(
    what: str, fn: Callable[[], T | None], cluster: LocalCluster, timeout: float = 30
) -> T:
    deadline = time.monotonic() + timeout
    while True:
        value = fn()
        if value:
            return value
        if time.monotonic() > deadline:
            assert cluster.kubelet is not None
            pytest.fail(f"timed out waiting for {what}\n{cluster.kubelet.describe()[-6000:]}")
        time.sleep(0.2)


def pod_spec(name: str, command: list[str], **extra: Any) -> dict[str, Any]:
    container = {"name": "main", "image": "test/python", "command": command}
    container.update(extra.pop("container", {}))
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": NS, "labels": {"test": name}},
        "spec": {"terminationGracePeriodSeconds": 5, "containers": [container], **extra},
    }


def sa(name: str) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": name}}


def env_from_fields() -> list[dict[str, Any]]:
    def field(name: str, path: str) -> dict[str, Any]:
        return {"name": name, "valueFrom": {"fieldRef": {"fieldPath": path}}}

    return [
        field("MY_POD_NAME", "metadata.name"),
        field("MY_NS", "metadata.namespace"),
        field("MY_POD_IP", "status.podIP"),
        field("MY_SA", "spec.serviceAccountName"),
        {"name": "PYTHONUNBUFFERED", "value": "1"},
    ]


@pytest.fixture(scope="module")
def cluster(
    local_cluster: LocalCluster, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[LocalCluster]:
    api = Api(local_cluster.kubeconfig)
    out = tmp_path_factory.mktemp("graceful")
    local_cluster.kubectl("create", "namespace", NS)
    wait_for(
        "the namespace's default service account",
        lambda: api.get_or_none(f"/api/v1/namespaces/{NS}/serviceaccounts/default"),
        local_cluster,
    )
    objects: list[dict[str, Any]] = [
        sa("nobody"),
        sa("reader"),
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "Role",
            "metadata": {"name": "pod-reader"},
            "rules": [{"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list"]}],
        },
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "RoleBinding",
            "metadata": {"name": "reader-reads-pods"},
            "roleRef": {
                "apiGroup": "rbac.authorization.k8s.io",
                "kind": "Role",
                "name": "pod-reader",
            },
            "subjects": [{"kind": "ServiceAccount", "name": "reader", "namespace": NS}],
        },
        {
            "apiVersion": "apps/v1",
            "kind": "Deployment",
            "metadata": {"name": "web"},
            "spec": {
                "replicas": 2,
                "selector": {"matchLabels": {"app": "web"}},
                "template": {
                    "metadata": {"labels": {"app": "web"}},
                    "spec": {
                        "terminationGracePeriodSeconds": 5,
                        "containers": [
                            {
                                "name": "http",
                                "image": "test/python",
                                "command": ["python", "-m", "http.server", "8080"],
                                "args": ["--bind", "0.0.0.0"],
                                "ports": [{"name": "http", "containerPort": 8080}],
                                "readinessProbe": {
                                    "httpGet": {"path": "/", "port": "http"},
                                    "periodSeconds": 1,
                                },
                            }
                        ],
                    },
                },
            },
        },
        {
            "apiVersion": "v1",
            "kind": "Service",
            "metadata": {"name": "web"},
            "spec": {"selector": {"app": "web"}, "ports": [{"port": 80, "targetPort": "http"}]},
        },
    ]
    for name, account in (("api-denied", "nobody"), ("api-allowed", "reader")):
        env = [
            *env_from_fields(),
            {"name": "ATTEMPTS", "value": "1" if account == "nobody" else "10"},
        ]
        objects.append(
            pod_spec(
                name,
                ["python", "-c", LIST_PODS],
                serviceAccountName=account,
                restartPolicy="Never",
                container={"env": env},
            )
        )
    objects += [
        *features_pod(),
        *restricted_pods(),
        pod_spec("crash", ["sh", "-c", "echo crashing; exit 1"]),
        pod_spec(
            "graceful",
            ["python", "-c", GRACEFUL],
            terminationGracePeriodSeconds=20,
            volumes=[{"name": "out", "hostPath": {"path": str(out), "type": "Directory"}}],
            container={"volumeMounts": [{"name": "out", "mountPath": "/out"}]},
        ),
        pod_spec(
            # Alive while /dev/shm/alive exists: only inside the pod's own tmpfs, so the
            # exec probe must run in the container's mount namespace to see it.
            "liveness",
            ["sh", "-c", "touch /dev/shm/alive; sleep 2; rm /dev/shm/alive; exec sleep 600"],
            volumes=[{"name": "dshm", "emptyDir": {"medium": "Memory"}}],
            container={
                "volumeMounts": [{"name": "dshm", "mountPath": "/dev/shm"}],
                "livenessProbe": {
                    "exec": {"command": ["cat", "/dev/shm/alive"]},
                    "periodSeconds": 1,
                    "failureThreshold": 1,
                },
            },
        ),
        pod_spec(
            "greedy",
            ["sleep", "600"],
            container={"resources": {"limits": {"nvidia.com/gpu": 5}}},
        ),
    ]
    for obj in objects:
        obj.setdefault("metadata", {})["namespace"] = NS
    local_cluster.kubectl(
        "apply", "-f", "-", input=json.dumps({"apiVersion": "v1", "kind": "List", "items": objects})
    )
    local_cluster.graceful_dir = out  # type: ignore[attr-defined]
    local_cluster.api = api  # type: ignore[attr-defined]
    try:
        yield local_cluster
    finally:
        local_cluster.kubectl("delete", "namespace", NS, "--wait=false", check=False)
        # The namespace controller gets to pods only after a while: delete them now
        # (its Terminating state keeps the ReplicaSet from making new ones).
        local_cluster.kubectl("-n", NS, "delete", "pods", "--all", "--wait=false", check=False)
        wait_for(
            "the test namespace's pods to go",
            lambda: not api.get(f"/api/v1/namespaces/{NS}/pods")["items"],
            local_cluster,
            timeout=30,
        )
        api.close()


def get_pod(cluster: LocalCluster, name: str) -> dict[str, Any] | None:
    return cluster.api.get_or_none(f"/api/v1/namespaces/{NS}/pods/{name}")  # type: ignore[attr-defined]


def condition(pod: dict[str, Any], kind: str) -> dict[str, Any]:
    return next((c for c in pod.get("status", {}).get("conditions", []) if c["type"] == kind), {})


def terminated(cluster: LocalCluster, name: str) -> dict[str, Any] | None:
    pod = get_pod(cluster, name)
    statuses = (pod or {}).get("status", {}).get("containerStatuses") or [{}]
    return statuses[0].get("state", {}).get("terminated")


def test_deployment_pods_ready_on_their_own_addresses_and_in_the_endpointslice(
    cluster: LocalCluster,
) -> None:
    api: Api = cluster.api  # type: ignore[attr-defined]

    def ready_pods() -> list[dict[str, Any]] | None:
        pods = api.get(f"/api/v1/namespaces/{NS}/pods", labelSelector="app=web")["items"]
        ready = [p for p in pods if condition(p, "Ready").get("status") == "True"]
        return ready if len(ready) == 2 else None

    pods = wait_for("both web pods Ready", ready_pods, cluster)
    ips = {p["status"]["podIP"] for p in pods}
    assert len(ips) == 2
    subnet = ipaddress.ip_network("10.244.0.0/24")
    for pod in pods:
        status = pod["status"]
        ip = ipaddress.ip_address(status["podIP"])
        assert ip in subnet and ip != subnet.network_address + 1
        assert status["phase"] == "Running"
        assert status["podIPs"] == [{"ip": status["podIP"]}]
        assert status["hostIP"] == "10.244.0.1"
        assert status["startTime"]
        (ctr,) = status["containerStatuses"]
        assert ctr["ready"] and ctr["started"] and ctr["restartCount"] == 0
        assert "running" in ctr["state"]
        assert {
            condition(pod, t)["status"] for t in ("Initialized", "ContainersReady", "PodScheduled")
        } == {"True"}
    for ip in ips:
        r = httpx.get(f"http://{ip}:8080/", timeout=5)
        assert r.status_code == 200

    def slice_ips() -> set[str] | None:
        slices = api.get(
            f"/apis/discovery.k8s.io/v1/namespaces/{NS}/endpointslices",
            labelSelector="kubernetes.io/service-name=web",
        )["items"]
        found = {
            address
            for s in slices
            for e in s.get("endpoints") or []
            if e.get("conditions", {}).get("ready")
            for address in e["addresses"]
        }
        return found if found == ips else None

    assert wait_for("the EndpointSlice to list both pods", slice_ips, cluster, timeout=20) == ips


def test_in_cluster_client_authenticates_as_the_pods_service_account(cluster: LocalCluster) -> None:
    assert cluster.kubelet is not None
    denied = wait_for(
        "api-denied to finish", lambda: terminated(cluster, "api-denied"), cluster, 45
    )
    allowed = wait_for(
        "api-allowed to finish", lambda: terminated(cluster, "api-allowed"), cluster, 45
    )
    denied_log = cluster.kubelet.pod_log("api-denied", NS)
    allowed_log = cluster.kubelet.pod_log("api-allowed", NS)
    assert denied["exitCode"] == 3, denied_log
    assert "status 403" in denied_log
    assert f"system:serviceaccount:{NS}:nobody" in denied_log  # the pod's own identity
    assert allowed["exitCode"] == 0, allowed_log
    assert "listed" in allowed_log
    pod = get_pod(cluster, "api-allowed")
    assert pod is not None and pod["status"]["phase"] == "Succeeded"
    host, port = cluster.kubelet.api_endpoint
    assert f"env {host} {port} api-allowed {pod['status']['podIP']} reader" in allowed_log
    denied_pod = get_pod(cluster, "api-denied")
    assert denied_pod is not None and denied_pod["status"]["phase"] == "Failed"


def test_init_containers_volumes_env_and_probes(cluster: LocalCluster) -> None:
    assert cluster.kubelet is not None

    def ready() -> dict[str, Any] | None:
        pod = get_pod(cluster, "features")
        return pod if condition(pod or {}, "Ready").get("status") == "True" else None

    pod = wait_for("features to be Ready", ready, cluster)
    log = cluster.kubelet.pod_log("features", NS, "main")
    lines = log.splitlines()
    assert lines[:4] == ["init-ran", "in-subpath", "65534", "from-configmap"], log
    assert "env hello s3cr3t hello-world $(GREETING) hello-arg" in lines, log
    assert 'test="features"' in lines, log
    assert "hostname features cwd /work" in lines, log
    assert "no-token" in lines, log
    init, whoami, sidecar = pod["status"]["initContainerStatuses"]
    for done in (init, whoami):
        assert done["state"]["terminated"]["exitCode"] == 0
        assert done["state"]["terminated"]["reason"] == "Completed"
    assert "running" in sidecar["state"] and sidecar["started"]
    (main,) = pod["status"]["containerStatuses"]
    assert main["started"] and main["ready"] and main["restartCount"] == 0
    assert httpx.get(f"http://{pod['status']['podIP']}:9000/init.txt").text == "init-ran\n"


def test_security_context_user_groups_and_read_only_root_are_honoured(
    cluster: LocalCluster,
) -> None:
    assert cluster.kubelet is not None

    def ready() -> dict[str, Any] | None:
        pod = get_pod(cluster, "restricted")
        return pod if condition(pod or {}, "Ready").get("status") == "True" else None

    wait_for("the restricted pod to be Ready (its probe runs as 10001)", ready, cluster)
    log = cluster.kubelet.pod_log("restricted", NS, "main").splitlines()
    assert log[:3] == ["ids 10001 10001 [10002]", "root EROFS", "tmp writable; secret s3cr3t"]
    assert not Path("/dpserve-rootfs-write-test").exists()

    def refused() -> dict[str, Any] | None:
        statuses = ((get_pod(cluster, "rootful") or {}).get("status") or {}).get(
            "containerStatuses"
        ) or [{}]
        waiting = statuses[0].get("state", {}).get("waiting") or {}
        return waiting if waiting.get("reason") == "CreateContainerConfigError" else None

    waiting = wait_for("runAsNonRoot without a user to be refused", refused, cluster)
    assert "runAsNonRoot and image will run as root" in waiting["message"]


def test_crashing_container_restarts_with_backoff(cluster: LocalCluster) -> None:
    seen: list[int] = []

    def crash_looping() -> dict[str, Any] | None:
        pod = get_pod(cluster, "crash")
        statuses = (pod or {}).get("status", {}).get("containerStatuses")
        if not statuses:
            return None
        ctr = statuses[0]
        seen.append(ctr["restartCount"])
        waiting = ctr["state"].get("waiting", {})
        if ctr["restartCount"] >= 2 and waiting.get("reason") == "CrashLoopBackOff":
            return ctr
        return None

    ctr = wait_for("crash to loop", crash_looping, cluster, timeout=30)
    assert seen == sorted(seen)  # never goes back
    assert ctr["lastState"]["terminated"]["exitCode"] == 1
    assert ctr["lastState"]["terminated"]["reason"] == "Error"
    assert not ctr["ready"]
    pod = get_pod(cluster, "crash")
    assert pod is not None and pod["status"]["phase"] == "Running"
    assert condition(pod, "Ready")["status"] == "False"


def test_failed_liveness_probe_restarts_the_container(cluster: LocalCluster) -> None:
    def restarted() -> dict[str, Any] | None:
        pod = get_pod(cluster, "liveness")
        statuses = (pod or {}).get("status", {}).get("containerStatuses") or [{}]
        return statuses[0] if statuses[0].get("restartCount", 0) >= 1 else None

    ctr = wait_for("the liveness pod to be restarted", restarted, cluster, timeout=30)
    last = ctr["lastState"]["terminated"]
    assert last["exitCode"] in (137, 143) and last["reason"] == "Error"


def test_deleting_a_pod_sends_sigterm_and_removes_it(cluster: LocalCluster) -> None:
    out: Path = cluster.graceful_dir  # type: ignore[attr-defined]
    wait_for("graceful to start", lambda: (out / "started").exists(), cluster)
    pod = get_pod(cluster, "graceful")
    assert pod is not None
    started = time.monotonic()
    cluster.kubectl("-n", NS, "delete", "pod", "graceful", "--wait=false")
    wait_for("graceful to be gone", lambda: get_pod(cluster, "graceful") is None, cluster, 15)
    assert (out / "sigterm").read_text() == "15"
    assert time.monotonic() - started < 15  # it left on SIGTERM, not at the 20 s deadline
    assert cluster.kubelet is not None
    assert pod["status"]["podIP"] not in cluster.kubelet.network.allocated  # torn down


def test_pod_asking_for_more_gpus_than_the_node_has_stays_pending(cluster: LocalCluster) -> None:
    def unschedulable() -> dict[str, Any] | None:
        pod = get_pod(cluster, "greedy")
        cond = condition(pod or {}, "PodScheduled")
        return cond if cond.get("reason") == "Unschedulable" else None

    cond = wait_for("greedy to be marked Unschedulable", unschedulable, cluster)
    assert cond["status"] == "False"
    assert "Insufficient nvidia.com/gpu" in cond["message"]
    pod = get_pod(cluster, "greedy")
    assert pod is not None
    assert pod["status"]["phase"] == "Pending" and not pod["spec"].get("nodeName")


def test_without_processes_many_pods_are_ready_at_once_and_deleted_fast(
    cluster: LocalCluster,
) -> None:
    """A second node whose kubelet starts nothing (for scale tests of the operator)."""
    taint = {"key": "dpserve.dev/fake", "value": "true", "effect": "NoSchedule"}
    fake = TestKubelet(
        cluster.kubeconfig,
        node_name="node-fake",
        network=cluster.network,
        run_processes=False,
        taints=[taint],
    ).start()
    api: Api = cluster.api  # type: ignore[attr-defined]
    n = 64
    deployment = {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": "many", "namespace": NS},
        "spec": {
            "replicas": n,
            "selector": {"matchLabels": {"app": "many"}},
            "template": {
                "metadata": {"labels": {"app": "many"}},
                "spec": {
                    "nodeSelector": {"kubernetes.io/hostname": "node-fake"},
                    "tolerations": [{**taint, "operator": "Equal"}],
                    "containers": [{"name": "c", "image": "none", "command": ["false"]}],
                },
            },
        },
    }
    try:
        api.post(f"/apis/apps/v1/namespaces/{NS}/deployments", deployment)

        def all_ready() -> dict[str, Any] | None:
            d = api.get(f"/apis/apps/v1/namespaces/{NS}/deployments/many")
            return d if d.get("status", {}).get("readyReplicas") == n else None

        wait_for(f"{n} fake pods Ready", all_ready, cluster, timeout=40)
        pods = api.get(f"/api/v1/namespaces/{NS}/pods", labelSelector="app=many")["items"]
        assert len({p["status"]["podIP"] for p in pods}) == n
        assert all(p["spec"]["nodeName"] == "node-fake" for p in pods)
        api.delete(
            f"/apis/apps/v1/namespaces/{NS}/deployments/many", {"propagationPolicy": "Foreground"}
        )

        def all_gone() -> bool:
            return not api.get(f"/api/v1/namespaces/{NS}/pods", labelSelector="app=many")["items"]

        wait_for("fake pods to be deleted", all_gone, cluster, timeout=30)
    finally:
        fake.stop()
    with pytest.raises(ApiError) as e:
        api.get("/api/v1/nodes/node-fake")
    assert e.value.status == 404
