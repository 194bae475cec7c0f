"""The real node: pods from a locally built image, run by containerd and runc.

Against the session's ``real_cluster`` (tests/conftest.py), whose teardown checks
that nothing is left behind. The OCI writer's own tests need no cluster.
"""

from __future__ import annotations

import hashlib
import io
import json
import tarfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx
import pytest

from tests.cluster.images import BUSYBOX_REF, busybox_image
from tests.cluster.oci import IMAGE_NAME, normalize_ref, write_oci_archive

if TYPE_CHECKING:
    from tests.cluster.realcluster import RealCluster

cluster_test = pytest.mark.cluster


# ---------------------------------------------------------------------- OCI writer


@pytest.mark.parametrize(
    ("ref", "normalized"),
    [
        ("busybox", "docker.io/library/busybox:latest"),
        ("dpserve-worker:0.1.0", "docker.io/library/dpserve-worker:0.1.0"),
        ("docker.io/busybox:1", "docker.io/library/busybox:1"),
        ("someone/tool:2", "docker.io/someone/tool:2"),
        ("localhost:5000/x", "localhost:5000/x:latest"),
        ("ghcr.io/a/b@sha256:00", "ghcr.io/a/b@sha256:00"),
    ],
)
def test_normalize_ref(ref: str, normalized: str) -> None:
    assert normalize_ref(ref) == normalized


def test_oci_archive_is_a_layout_whose_digests_hold(tmp_path: Path) -> None:
    rootfs = tmp_path / "rootfs"
    (rootfs / "bin").mkdir(parents=True)
    (rootfs / "bin" / "hello").write_text("#!/bin/sh\necho hi\n")
    (rootfs / "bin" / "hi").symlink_to("hello")
    first, second = io.BytesIO(), io.BytesIO()
    config_digest = write_oci_archive(first, rootfs, "t:1")
    assert write_oci_archive(second, rootfs, "t:1") == config_digest
    assert first.getvalue() == second.getvalue()  # reproducible, byte for byte

    first.seek(0)
    with tarfile.open(fileobj=first) as tar:
        files = {m.name: tar.extractfile(m).read() for m in tar if m.isfile()}  # type: ignore[union-attr]
    for name, data in files.items():
        if name.startswith("blobs/sha256/"):
            assert hashlib.sha256(data).hexdigest() == name.rsplit("/", 1)[1]
    assert json.loads(files["oci-layout"]) == {"imageLayoutVersion": "1.0.0"}
    (entry,) = json.loads(files["index.json"])["manifests"]
    assert entry["annotations"][IMAGE_NAME] == "docker.io/library/t:1"
    manifest = json.loads(files[f"blobs/sha256/{entry['digest'].split(':')[1]}"])
    assert manifest["config"]["digest"] == config_digest
    (layer,) = manifest["layers"]
    with tarfile.open(fileobj=io.BytesIO(files[f"blobs/sha256/{layer['digest'][7:]}"])) as tar:
        members = {m.name: m for m in tar}
    assert sorted(members) == ["bin", "bin/hello", "bin/hi"]
    assert members["bin/hi"].issym() and members["bin/hi"].linkname == "hello"
    assert {(m.uid, m.gid, m.mtime) for m in members.values()} == {(0, 0, 0)}


# ---------------------------------------------------------------------- helpers


def _apply(cluster: RealCluster, *objects: dict[str, Any]) -> None:
    cluster.kubectl(
        "apply",
        "-f",
        "-",
        input=json.dumps({"kind": "List", "apiVersion": "v1", "items": list(objects)}),
    )


def _pod(name: str, script: str, **spec: Any) -> dict[str, Any]:
    container = {
        "name": "main",
        "image": BUSYBOX_REF,
        "imagePullPolicy": "Never",
        "command": ["sh", "-c", script],
        **spec.pop("container", {}),
    }
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "labels": {"app": name, "test": "node"}},
        "spec": {"containers": [container], "terminationGracePeriodSeconds": 5, **spec},
    }


def _get(cluster: RealCluster, kind: str, name: str) -> dict[str, Any]:
    got: dict[str, Any] = json.loads(cluster.kubectl("get", kind, name, "-o", "json").stdout)
    return got


def _wait(cluster: RealCluster, name: str, done: Any, timeout_s: float = 60) -> dict[str, Any]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        pod = _get(cluster, "pod", name)
        if done(pod):
            return pod
        time.sleep(0.2)
    events = cluster.kubectl("get", "events", f"--field-selector=involvedObject.name={name}").stdout
    raise AssertionError(f"pod {name}: {json.dumps(pod.get('status'))}\n{events}")


def _phase(*phases: str) -> Any:
    return lambda pod: pod["status"].get("phase") in phases


def _ready(pod: dict[str, Any]) -> bool:
    conditions = pod["status"].get("conditions", [])
    return any(c["type"] == "Ready" and c["status"] == "True" for c in conditions)


def _run_to_completion(cluster: RealCluster, pod: dict[str, Any]) -> tuple[dict[str, Any], str]:
    pod["spec"]["restartPolicy"] = "Never"
    _apply(cluster, pod)
    name = pod["metadata"]["name"]
    done = _wait(cluster, name, _phase("Succeeded", "Failed"))
    return done, cluster.kubectl("logs", name).stdout


@pytest.fixture(scope="module")
def cluster(real_cluster: RealCluster) -> Iterator[RealCluster]:
    archive = io.BytesIO()
    image_id = busybox_image(archive)
    archive.seek(0)
    real_cluster.node.import_image(archive)
    assert real_cluster.node.image_id(BUSYBOX_REF) == image_id
    yield real_cluster


@pytest.fixture(autouse=True)
def _clean_namespace(request: pytest.FixtureRequest) -> Iterator[None]:
    """Each test's pods and Services go when it ends (not waited for: the next
    test's names differ)."""
    yield
    if "cluster" in request.fixturenames:
        cluster: RealCluster = request.getfixturevalue("cluster")
        cluster.kubectl("delete", "pods,services", "-l", "test=node", "--wait=false")


# ---------------------------------------------------------------------- the node


@cluster_test
def test_node_is_ready_with_gpus(cluster: RealCluster) -> None:
    node = _get(cluster, "node", "node-1")
    assert any(c["type"] == "Ready" and c["status"] == "True" for c in node["status"]["conditions"])
    assert node["status"]["allocatable"]["nvidia.com/gpu"] == "4"
    assert node["status"]["capacity"]["nvidia.com/gpu"] == "4"
    assert node["status"]["nodeInfo"]["containerRuntimeVersion"].startswith("containerd://")
    assert node["status"]["nodeInfo"]["kubeletVersion"] == "v1.33.13"


@cluster_test
def test_image_is_imported_and_removed(cluster: RealCluster, tmp_path: Path) -> None:
    rootfs = tmp_path / "rootfs"
    rootfs.mkdir()
    (rootfs / "file").write_text("x")
    archive = tmp_path / "image.tar"
    with archive.open("wb") as f:
        config_digest = write_oci_archive(f, rootfs, "dpserve-throwaway:1")
    cluster.node.import_image(archive)
    assert cluster.node.image_id("dpserve-throwaway:1") == config_digest
    assert cluster.node.image_id("docker.io/library/dpserve-throwaway:1") == config_digest
    cluster.node.remove_image("dpserve-throwaway:1")
    assert cluster.node.image_id("dpserve-throwaway:1") is None
    assert cluster.node.containerd is not None  # nor the ID that CRI names it by
    listed = cluster.node.containerd.ctr("images", "ls", "--quiet").stdout.split()
    assert config_digest not in listed


@cluster_test
def test_security_context_is_enforced_by_the_runtime(cluster: RealCluster) -> None:
    script = """
        id -u
        touch /rootfs-write 2>/dev/null && echo root-writable || echo root-read-only
        touch /scratch/file && echo scratch-writable
        grep CapEff /proc/self/status
    """
    pod = _pod(
        "secctx",
        script,
        container={
            "securityContext": {
                "runAsUser": 10001,
                "runAsGroup": 10001,
                "runAsNonRoot": True,
                "readOnlyRootFilesystem": True,
                "allowPrivilegeEscalation": False,
                "capabilities": {"drop": ["ALL"]},
            },
            "volumeMounts": [{"name": "scratch", "mountPath": "/scratch"}],
        },
        volumes=[{"name": "scratch", "emptyDir": {}}],
    )
    done, logs = _run_to_completion(cluster, pod)
    assert done["status"]["phase"] == "Succeeded", logs
    assert logs.split() == [
        "10001",
        "root-read-only",
        "scratch-writable",
        "CapEff:",
        "0000000000000000",
    ]
    (status,) = done["status"]["containerStatuses"]
    assert status["imageID"].endswith(cluster.node.image_id(BUSYBOX_REF) or "absent")
    # The node's containerd ran it with runc.
    assert cluster.node.containerd is not None
    container_id = status["containerID"].removeprefix("containerd://")
    info = json.loads(cluster.node.containerd.ctr("containers", "info", container_id).stdout)
    assert info["Runtime"]["Name"] == "io.containerd.runc.v2"


@cluster_test
def test_pod_reaches_the_apiserver_through_the_kubernetes_service(cluster: RealCluster) -> None:
    # In-cluster config as a client library reads it: the Service's env and the token.
    script = """
        echo "$KUBERNETES_SERVICE_HOST:$KUBERNETES_SERVICE_PORT"
        sa=/var/run/secrets/kubernetes.io/serviceaccount
        wget -q -O- --no-check-certificate --header "Authorization: Bearer $(cat $sa/token)" \
            "https://$KUBERNETES_SERVICE_HOST:$KUBERNETES_SERVICE_PORT/version"
    """
    done, logs = _run_to_completion(cluster, _pod("incluster", script))
    assert done["status"]["phase"] == "Succeeded", logs
    service_ip = _get(cluster, "service", "kubernetes")["spec"]["clusterIP"]
    first, rest = logs.split("\n", 1)
    assert first == f"{service_ip}:443"
    assert json.loads(rest)["gitVersion"] == "v1.33.13"


@cluster_test
def test_host_and_pods_reach_a_pod_through_its_service(cluster: RealCluster) -> None:
    script = """
        mkdir -p /tmp/www && echo hello-from-web > /tmp/www/index.html
        exec httpd -f -p 8080 -h /tmp/www
    """
    web = _pod("web", script)
    web["spec"]["containers"][0]["readinessProbe"] = {
        "tcpSocket": {"port": 8080},
        "periodSeconds": 1,
    }
    service = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": "web", "labels": {"test": "node"}},
        "spec": {"selector": {"app": "web"}, "ports": [{"port": 80, "targetPort": 8080}]},
    }
    _apply(cluster, web, service)
    _wait(cluster, "web", _ready)
    ip = _get(cluster, "service", "web")["spec"]["clusterIP"]
    cluster.node.wait_routed(ip)
    response = httpx.get(f"http://{ip}/", timeout=5)
    assert response.text == "hello-from-web\n"
    # The pod reaches itself through its own Service (hairpin, masquerade).
    fetch = ("exec", "web", "--", "timeout", "5", "wget", "-q", "-O-", f"http://{ip}/")
    got = cluster.kubectl(*fetch, check=False)
    assert got.stdout == "hello-from-web\n", got.stderr


@cluster_test
def test_gpu_requests_schedule_against_the_advertised_count(cluster: RealCluster) -> None:
    one = _pod("gpu-one", "echo ran", container={"resources": {"limits": {"nvidia.com/gpu": 1}}})
    done, logs = _run_to_completion(cluster, one)
    assert done["status"]["phase"] == "Succeeded" and logs == "ran\n"
    assert done["spec"]["nodeName"] == "node-1"

    five = _pod("gpu-five", "echo ran", container={"resources": {"limits": {"nvidia.com/gpu": 5}}})
    _apply(cluster, five)
    pod = _wait(
        cluster,
        "gpu-five",
        lambda p: any(
            c.get("reason") == "Unschedulable" for c in p["status"].get("conditions", [])
        ),
        timeout_s=20,
    )
    assert "nvidia.com/gpu" in pod["status"]["conditions"][0]["message"]


def _hostpath_pod(name: str, script: str, out: Path, grace_s: int) -> dict[str, Any]:
    pod = _pod(
        name,
        script,
        container={"volumeMounts": [{"name": "out", "mountPath": "/out"}]},
        volumes=[{"name": "out", "hostPath": {"path": str(out), "type": "Directory"}}],
    )
    pod["spec"]["terminationGracePeriodSeconds"] = grace_s
    return pod


@cluster_test
def test_delete_sends_sigterm_to_pid_1(cluster: RealCluster, tmp_path: Path) -> None:
    script = "trap 'echo term > /out/marker; exit 0' TERM; while true; do sleep 0.2; done"
    _apply(cluster, _hostpath_pod("sigterm", script, tmp_path, grace_s=30))
    _wait(cluster, "sigterm", _phase("Running"))
    start = time.monotonic()
    cluster.kubectl("delete", "pod", "sigterm", "--wait=true", "--timeout=60s")
    assert time.monotonic() - start < 10  # exited on TERM, well before its 30 s grace
    assert (tmp_path / "marker").read_text() == "term\n"


@cluster_test
def test_delete_waits_the_grace_period_for_pid_1_ignoring_sigterm(
    cluster: RealCluster, tmp_path: Path
) -> None:
    script = "trap '' TERM; echo up > /out/up; while true; do sleep 0.2; done"
    _apply(cluster, _hostpath_pod("stubborn", script, tmp_path, grace_s=3))
    _wait(cluster, "stubborn", _phase("Running"))
    start = time.monotonic()
    cluster.kubectl("delete", "pod", "stubborn", "--wait=true", "--timeout=60s")
    assert 3 <= time.monotonic() - start < 15  # killed once the grace period ran out
