"""Two real nodes on this machine: both Ready, each with its own pods, one pod network.

The session's ``real_cluster`` (tests/conftest.py) starts with one node; this module
adds the second (``ensure_nodes(2)``) and the cluster keeps it until the session ends,
when its teardown checks that neither node left anything behind.
"""

from __future__ import annotations

import io
import json
import time
from collections.abc import Iterator
from ipaddress import IPv4Address
from typing import TYPE_CHECKING, Any

import httpx
import pytest

from tests.cluster import hoststate
from tests.cluster.images import BUSYBOX_REF, busybox_image
from tests.cluster.test_node import _apply, _get, _pod, _ready, _wait
from tests.polling import eventually

if TYPE_CHECKING:
    from tests.cluster.realcluster import RealCluster

pytestmark = pytest.mark.cluster


@pytest.fixture(scope="module")
def two(real_cluster: RealCluster) -> Iterator[RealCluster]:
    started = time.monotonic()
    added = len(real_cluster.nodes) < 2
    nodes = real_cluster.ensure_nodes(2)
    if added:  # the cost a second node adds to a run (reported, not asserted)
        print(f"second node Ready in {time.monotonic() - started:.1f} s")
    image_id = None
    for node in nodes:
        archive = io.BytesIO()
        image_id = busybox_image(archive)
        archive.seek(0)
        node.import_image(archive)
        assert node.image_id(BUSYBOX_REF) == image_id
    yield real_cluster
    real_cluster.kubectl(
        "delete", "pods,services,networkpolicies", "-l", "test=two-nodes", "--wait=true"
    )
    real_cluster.shrink_to(1)  # the tests after this module were written for one node


def _web(name: str, node: str) -> list[dict[str, Any]]:
    """A pod pinned to ``node`` that answers its own name over HTTP, and its Service."""
    script = f"""
        mkdir -p /tmp/www && echo {name} > /tmp/www/index.html
        exec httpd -f -p 8080 -h /tmp/www
    """
    pod = _pod(name, script, nodeName=node)
    pod["metadata"]["labels"]["test"] = "two-nodes"
    pod["spec"]["containers"][0]["readinessProbe"] = {
        "tcpSocket": {"port": 8080},
        "periodSeconds": 1,
    }
    service = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": name, "labels": {"test": "two-nodes"}},
        "spec": {"selector": {"app": name}, "ports": [{"port": 80, "targetPort": 8080}]},
    }
    return [pod, service]


def _fetch(cluster: RealCluster, pod: str, url: str) -> str:
    got = cluster.kubectl("exec", pod, "--", "timeout", "5", "wget", "-q", "-O-", url, check=False)
    assert got.returncode == 0, f"{pod} → {url}: {got.stderr}"
    return got.stdout


def test_both_nodes_are_ready_with_the_host_address_and_a_kubelet_port_each(
    two: RealCluster,
) -> None:
    nodes = {
        n["metadata"]["name"]: n
        for n in json.loads(two.kubectl("get", "nodes", "-o", "json").stdout)["items"]
    }
    assert sorted(nodes) == ["node-1", "node-2"]
    addresses, ports = set(), set()
    for node in nodes.values():
        status = node["status"]
        assert any(c["type"] == "Ready" and c["status"] == "True" for c in status["conditions"])
        assert status["allocatable"]["nvidia.com/gpu"] == "4"
        (internal,) = [a["address"] for a in status["addresses"] if a["type"] == "InternalIP"]
        addresses.add(internal)
        ports.add(status["daemonEndpoints"]["kubeletEndpoint"]["Port"])
        assert node["metadata"]["labels"]["kubernetes.io/hostname"] == node["metadata"]["name"]
    # One network namespace, one address (nodelayout.py); the apiserver tells the
    # kubelets apart by port (kubectl exec reaches each below).
    assert addresses == {two.network.gateway} and len(ports) == 2


def test_pods_on_either_node_reach_each_other_services_and_the_apiserver(
    two: RealCluster,
) -> None:
    _apply(two, *_web("web-1", "node-1"), *_web("web-2", "node-2"))
    pods = {name: _wait(two, name, _ready) for name in ("web-1", "web-2")}
    for name, node in (("web-1", two.nodes[0]), ("web-2", two.nodes[1])):
        assert pods[name]["spec"]["nodeName"] == node.name
        assert node.ip_range is not None
        first, last = (IPv4Address(a) for a in node.ip_range)
        ip = IPv4Address(pods[name]["status"]["podIP"])
        assert first <= ip <= last, (name, ip, node.ip_range)
    # Each kubelet keeps its pods in its own cgroup tree: neither removes the other's.
    assert hoststate.kubepods_processes("kubepods")
    assert hoststate.kubepods_processes("dpserve-node-2")

    services = {name: _get(two, "service", name)["spec"]["clusterIP"] for name in pods}
    for ip in services.values():
        two.node.wait_routed(ip)  # the one kube-proxy, node-1's, routes for both nodes
    # Across nodes, pod to pod and pod to Service (kubectl exec goes through each
    # node's own kubelet).
    assert _fetch(two, "web-1", f"http://{pods['web-2']['status']['podIP']}:8080/") == "web-2\n"
    assert _fetch(two, "web-2", f"http://{pods['web-1']['status']['podIP']}:8080/") == "web-1\n"
    assert _fetch(two, "web-1", f"http://{services['web-2']}/") == "web-2\n"
    assert _fetch(two, "web-2", f"http://{services['web-1']}/") == "web-1\n"
    # The host reaches a pod of the second node through its Service.
    assert httpx.get(f"http://{services['web-2']}/", timeout=5).text == "web-2\n"
    # A pod of the second node reaches the apiserver through the `kubernetes` Service.
    script = """
        sa=/var/run/secrets/kubernetes.io/serviceaccount
        wget -q -O- --no-check-certificate --header "Authorization: Bearer $(cat $sa/token)" \
            "https://$KUBERNETES_SERVICE_HOST:$KUBERNETES_SERVICE_PORT/version"
    """
    got = two.kubectl("exec", "web-2", "--", "sh", "-c", script, check=False)
    assert json.loads(got.stdout or "{}").get("gitVersion") == "v1.33.13", got.stderr


def _gets(cluster: RealCluster, pod: str, ip: str) -> bool:
    """Whether ``pod`` gets a web pod's page at ``ip`` (a rejected SYN fails at once,
    a dropped one within the 3 s)."""
    url = f"http://{ip}:8080/"
    got = cluster.kubectl("exec", pod, "--", "timeout", "3", "wget", "-q", "-O-", url, check=False)
    return got.returncode == 0


def test_the_one_policy_engine_guards_the_pods_of_both_nodes(two: RealCluster) -> None:
    """kube-router runs once, with the first node (tests/cluster/policy.py), and guards
    the pods whose hostIP is its node's: on this host, every node's. A policy admitting
    only friends stops strangers on either node from reaching pods on either node."""
    friend = _pod("friend", "exec sleep 3600", nodeName="node-1")
    stranger = _pod("stranger", "exec sleep 3600", nodeName="node-2")
    for pod, role in ((friend, "friend"), (stranger, "stranger")):
        pod["metadata"]["labels"].update(test="two-nodes", role=role)
        pod["spec"]["terminationGracePeriodSeconds"] = 0
    _apply(two, *_web("web-1", "node-1"), *_web("web-2", "node-2"), friend, stranger)
    names = ("web-1", "web-2", "friend", "stranger")
    ip = {name: _wait(two, name, _ready, 90)["status"]["podIP"] for name in names}
    # Without a policy every pod gets through: what follows is the policy's doing.
    eventually(lambda: _gets(two, "stranger", ip["web-1"]), 30, "the stranger reaches web-1")
    assert _gets(two, "stranger", ip["web-2"])

    only_friends = {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": {"name": "only-friends", "labels": {"test": "two-nodes"}},
        "spec": {
            "podSelector": {"matchExpressions": [
                {"key": "app", "operator": "In", "values": ["web-1", "web-2"]}]},
            "policyTypes": ["Ingress"],
            "ingress": [{"from": [{"podSelector": {"matchLabels": {"role": "friend"}}}],
                         "ports": [{"protocol": "TCP", "port": 8080}]}],
        },
    }  # fmt: skip
    _apply(two, only_friends)
    eventually(lambda: not _gets(two, "stranger", ip["web-2"]), 30, "the policy applied")
    assert not _gets(two, "stranger", ip["web-1"])  # node-2 to node-1
    assert not _gets(two, "web-1", ip["web-2"])  # node-1 to node-2: web-1 is no friend
    assert _gets(two, "friend", ip["web-2"])  # node-1 to node-2, admitted
    assert _gets(two, "friend", ip["web-1"])  # on node-1, admitted
