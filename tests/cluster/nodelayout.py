"""How several real test nodes share this one machine: a pure plan, one entry per node.

Every node runs on the host's network namespace, on the harness's one bridge, so every
node has the host's address there: the bridge's gateway (the apiserver binds it too)
is each node's InternalIP, and each kubelet serves its API on a port of its own. What
would collide between two kubelets and two containerds is given to each its own:

- a name (``node-1``, ``node-2``);
- a run directory (kubelet root, containerd socket and state, pid files, CNI
  leases) and a containerd root in the cache (a containerd holds its metadata
  database locked, so two cannot share one);
- a cgroup root for pods: the first node keeps the kubelet's default (``/kubepods``),
  later ones get ``/<run dir name>`` (``/dpserve-node-2/kubepods``), so no kubelet
  removes the other's pod cgroups as orphans;
- a slice of the subnet's addresses for its pods (host-local's ``rangeStart`` and
  ``rangeEnd``): every pod stays on the one /24, on-link to every other pod, so pods
  of different nodes reach each other over the bridge with no route to add.

Only the first node owns host-wide state (kube-proxy, the policy engine, the FORWARD
rules, ``ip_forward``, the ``KUBE-*`` chains): the others share its network namespace,
where one kube-proxy serves every pod's Service traffic and one policy engine guards
every pod (it guards the pods whose hostIP is its node's address: all of them).
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass
from pathlib import Path

# Two is what the tests need (drain, node loss); a third only needs its own slice.
MAX_NODES = 2


@dataclass(frozen=True)
class NodeLayout:
    index: int  # 0 for the first node
    name: str
    node_ip: str  # the host's address on the bridge, the same for every node
    ip_range: tuple[str, str]  # the first and last address host-local hands its pods
    run_dir: Path
    cache: Path
    cgroup_root: str | None  # None: the kubelet's default, "/" (pods in /kubepods)

    @property
    def host_owner(self) -> bool:
        """The first node runs kube-proxy and owns the host-wide state."""
        return self.index == 0

    @property
    def cgroup_top(self) -> str:
        return cgroup_top(self.cgroup_root)


def cgroup_top(cgroup_root: str | None) -> str:
    """The top cgroup (in every hierarchy) that holds a node's pods: the kubelet puts
    them in ``<cgroupRoot>/kubepods``, and its default root is ``/``."""
    return (cgroup_root or "/kubepods").strip("/")


def node_layout(index: int, subnet: str, run_dir: Path, cache: Path) -> NodeLayout:
    """Node ``index``'s share of this machine on ``subnet`` (the bridge's). Node 1's
    paths are ``run_dir`` and ``cache``, node k's the same with ``-k`` appended.

    Nothing depends on how many nodes run, so a node added to a running cluster
    takes exactly what a cluster started with it would have given it."""
    if not 0 <= index < MAX_NODES:
        raise ValueError(f"node index {index}: this harness runs 1 to {MAX_NODES} real nodes")
    hosts = list(ipaddress.ip_network(subnet).hosts())
    gateway, pod_ips = hosts[0], hosts[1:]
    share = len(pod_ips) // MAX_NODES
    suffix = "" if index == 0 else f"-{index + 1}"
    node_run_dir = run_dir.with_name(run_dir.name + suffix)
    return NodeLayout(
        index=index,
        name=f"node-{index + 1}",
        node_ip=str(gateway),
        ip_range=(str(pod_ips[index * share]), str(pod_ips[(index + 1) * share - 1])),
        run_dir=node_run_dir,
        cache=cache.with_name(cache.name + suffix),
        cgroup_root=None if index == 0 else f"/{node_run_dir.name}",
    )
