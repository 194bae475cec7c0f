"""NetworkPolicy is enforced on the real node (tests/cluster/policy.py: kube-router).

Pods in a namespace of their own (a policy there touches no other test's pods): a
busybox web server, a client without labels and a client labelled as a friend. The
connection is tried from inside the clients (``kubectl exec``), so the packets take the
path a pod's do: veth, bridge, the node's FORWARD chain. The node itself always gets
through (kube-router admits a pod's own node, for the kubelet's probes), so a
connection from the test process would prove nothing.
"""

from __future__ import annotations

import io
import json
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import pytest

from tests.cluster.images import BUSYBOX_REF, busybox_image
from tests.polling import eventually

if TYPE_CHECKING:
    from tests.cluster.realcluster import RealCluster

pytestmark = pytest.mark.cluster
NS = "netpol"
PORT = 8080


def _pod(name: str, labels: dict[str, str], script: str) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": NS, "labels": labels},
        "spec": {
            "terminationGracePeriodSeconds": 0,
            "containers": [
                {
                    "name": "main",
                    "image": BUSYBOX_REF,
                    "imagePullPolicy": "Never",
                    "command": ["sh", "-c", script],
                    # Ready once it listens (the web server) or at once (the clients);
                    # the kubelet's probe comes from the node, which policy admits.
                    "readinessProbe": {"exec": {"command": ["true"]}, "periodSeconds": 1},
                }
            ],
        },
    }


def _policy(name: str, ingress: list[dict[str, Any]]) -> dict[str, Any]:
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": {"name": name, "namespace": NS},
        "spec": {"podSelector": {}, "policyTypes": ["Ingress"], "ingress": ingress},
    }


def _apply(cluster: RealCluster, *objects: dict[str, Any]) -> None:
    items = {"apiVersion": "v1", "kind": "List", "items": list(objects)}
    cluster.kubectl("apply", "-f", "-", input=json.dumps(items))


def _reaches(cluster: RealCluster, client: str, ip: str) -> bool:
    """Whether ``client`` gets the web server's page (2 s to connect: a rejected or
    dropped SYN fails within it). busybox's nc, not its wget: ``wget -T`` segfaults
    in these containers."""
    request = f"printf 'GET / HTTP/1.0\\r\\n\\r\\n' | nc -w 2 {ip} {PORT}"
    got = cluster.kubectl("-n", NS, "exec", client, "--", "sh", "-c", request, check=False)
    return got.returncode == 0 and got.stdout.splitlines()[-1:] == ["web"]  # the body


@pytest.fixture(scope="module")
def cluster(real_cluster: RealCluster) -> Iterator[RealCluster]:
    archive = io.BytesIO()
    busybox_image(archive)
    archive.seek(0)
    real_cluster.node.import_image(archive)
    real_cluster.kubectl("create", "namespace", NS)
    try:
        yield real_cluster
    finally:
        real_cluster.kubectl("delete", "namespace", NS, "--wait=false")


def _ready(cluster: RealCluster, names: list[str]) -> dict[str, str]:
    """Pod IPs by name, once all of ``names`` are Ready."""

    def ips() -> dict[str, str]:
        pods = json.loads(cluster.kubectl("-n", NS, "get", "pods", "-o", "json").stdout)
        ready = {
            p["metadata"]["name"]: p["status"]["podIP"]
            for p in pods["items"]
            if any(
                c["type"] == "Ready" and c["status"] == "True"
                for c in p["status"].get("conditions", [])
            )
        }
        return ready if set(names) <= set(ready) else {}

    return eventually(ips, 90, f"pods {names} Ready")


def test_default_deny_stops_a_pod_and_an_allowing_policy_lets_a_labelled_one_through(
    cluster: RealCluster,
) -> None:
    serve = f"mkdir -p /tmp/w && echo web > /tmp/w/index.html && exec httpd -f -p {PORT} -h /tmp/w"
    _apply(
        cluster,
        _pod("web", {"app": "web"}, serve),
        _pod("stranger", {"app": "stranger"}, "exec sleep 3600"),
        _pod("friend", {"app": "friend", "role": "friend"}, "exec sleep 3600"),
    )
    web = _ready(cluster, ["web", "stranger", "friend"])["web"]
    # Without a policy both get through: what follows is the policy's doing.
    eventually(lambda: _reaches(cluster, "stranger", web), 30, "stranger reaches web")
    assert _reaches(cluster, "friend", web)

    _apply(cluster, _policy("deny-all", []))
    eventually(lambda: not _reaches(cluster, "stranger", web), 30, "default deny applied")
    assert not _reaches(cluster, "friend", web)

    friends = [{"from": [{"podSelector": {"matchLabels": {"role": "friend"}}}],
                "ports": [{"protocol": "TCP", "port": PORT}]}]  # fmt: skip
    _apply(cluster, _policy("friends", friends))
    eventually(lambda: _reaches(cluster, "friend", web), 30, "the friend admitted")
    assert not _reaches(cluster, "stranger", web)  # policies add up: still denied

    # The engine follows labels: the stranger relabelled becomes a friend.
    cluster.kubectl("-n", NS, "label", "pod", "stranger", "role=friend")
    eventually(lambda: _reaches(cluster, "stranger", web), 30, "the relabelled pod admitted")
