"""How two real test nodes share one machine (tests/cluster/nodelayout.py), and the
configuration the second one gets from it: pure builders, no cluster."""

from __future__ import annotations

import ipaddress
from pathlib import Path
from typing import Any

import pytest

from tests.cluster import cni
from tests.cluster.nodeconfig import kubelet_config
from tests.cluster.nodelayout import MAX_NODES, NodeLayout, node_layout

SUBNET = "10.245.0.0/24"
RUN, CACHE = Path("/var/lib/dpserve-node"), Path("/cache/node")


def layouts() -> list[NodeLayout]:
    return [node_layout(i, SUBNET, RUN, CACHE) for i in range(MAX_NODES)]


def test_the_first_node_is_the_one_node_harness_as_it_was() -> None:
    first = node_layout(0, SUBNET, RUN, CACHE)
    assert (first.name, first.node_ip, first.run_dir, first.cache) == (
        "node-1",
        "10.245.0.1",
        RUN,
        CACHE,
    )
    assert first.cgroup_root is None and first.cgroup_top == "kubepods"
    assert first.host_owner


def test_the_second_node_has_its_own_name_paths_and_cgroup_root_and_the_host_address() -> None:
    second = node_layout(1, SUBNET, RUN, CACHE)
    # The host's address: both nodes live in its network namespace, so the one policy
    # engine, which guards the pods whose hostIP is its node's, guards both nodes' pods.
    assert (second.name, second.node_ip) == ("node-2", node_layout(0, SUBNET, RUN, CACHE).node_ip)
    assert second.run_dir == Path("/var/lib/dpserve-node-2")
    assert second.cache == Path("/cache/node-2")
    assert (second.cgroup_root, second.cgroup_top) == ("/dpserve-node-2", "dpserve-node-2")
    assert not second.host_owner


def test_pod_ranges_are_disjoint_in_the_subnet_and_miss_the_node_ip() -> None:
    subnet = ipaddress.ip_network(SUBNET)
    spans: list[set[int]] = []
    for layout in layouts():
        first, last = (ipaddress.IPv4Address(a) for a in layout.ip_range)
        assert first in subnet and last in subnet and first < last
        spans.append(set(range(int(first), int(last) + 1)))
    assert all(not (x & y) for i, x in enumerate(spans) for y in spans[i + 1 :])
    node_ips = {int(ipaddress.ip_address(x.node_ip)) for x in layouts()}
    assert len(node_ips) == 1
    assert not node_ips & set[int]().union(*spans)


def test_a_node_index_beyond_the_harness_is_refused() -> None:
    with pytest.raises(ValueError, match="1 to 2 real nodes"):
        node_layout(MAX_NODES, SUBNET, RUN, CACHE)


def test_the_cni_range_is_the_node_slice_of_the_shared_subnet() -> None:
    config = cni.conflist(
        "dpnbr0", SUBNET, "10.245.0.1", Path("/ipam"), ("10.245.0.128", "10.245.0.253")
    )
    (span,) = config["plugins"][0]["ipam"]["ranges"][0]
    assert span == {
        "subnet": SUBNET,
        "gateway": "10.245.0.1",
        "rangeStart": "10.245.0.128",
        "rangeEnd": "10.245.0.253",
    }
    whole = cni.conflist("dpnbr0", SUBNET, "10.245.0.1", Path("/ipam"))
    assert whole["plugins"][0]["ipam"]["ranges"] == [[{"subnet": SUBNET, "gateway": "10.245.0.1"}]]


def test_the_kubelet_gets_a_cgroup_root_only_when_asked() -> None:
    def config(cgroup_root: str | None) -> dict[str, Any]:
        return kubelet_config(
            node_ip="10.245.0.1",
            port=1,
            healthz_port=2,
            ca_file=Path("/ca"),
            runtime_socket=Path("/sock"),
            pod_logs=Path("/logs"),
            cgroup_root=cgroup_root,
        )

    assert "cgroupRoot" not in config(None)
    assert config("/dpserve-node-2")["cgroupRoot"] == "/dpserve-node-2"
