"""The test node's NetworkPolicy engine: kube-router's firewall, a host process.

Why kube-router: the SIG Network engine (``sigs.k8s.io/kube-network-policies``, what
kind runs) hands packets to user space through nftables' ``queue`` statement, and this
machine's kernel has no ``CONFIG_NFT_QUEUE``. kube-router's network-policy controller
needs only iptables (with the xtables ``set``, ``physdev``, ``mark`` and ``comment``
matches), ipset (``hash:ip``, ``hash:net``) and ``br_netfilter``, all in this kernel
(docs/test-cluster.md). Only its firewall runs: the bridge CNI plugin wires the pods
and kube-proxy serves the Services, as without it.

It drives the same ``iptables`` the node's other parts use (Debian's, nf_tables
backend): one rule set, one backend. Its chains are ``KUBE-ROUTER-*``, ``KUBE-POD-FW-*``
and ``KUBE-NWPLCY-*`` (``hoststate.remove_node_rules`` removes every ``KUBE-`` chain)
and its ipsets ``KUBE-SRC-*``/``KUBE-DST-*`` (``hoststate.remove_node_ipsets``), so the
node's leftover cleanup covers a killed run too.

One engine per host network namespace: each instance removes the ``KUBE-POD-FW-*``
chains of pods that are not its node's, so two nodes sharing this host's netfilter
cannot run one each. One is enough: it takes as its own the pods whose ``hostIP`` is
its node's InternalIP, and every node on this host has the host's address
(nodelayout.py), so it guards every node's pods.

Identity: a client cert for ``system:dpserve:kube-router``, bound to a ClusterRole
that reads what its controller watches (nothing more: it writes nothing to the API).
"""

from __future__ import annotations

import json
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dpserve.plumbing.ports import free_ports
from tests.cluster.controlplane import ControlPlane
from tests.cluster.daemon import Daemon

NAME = "kube-router"
USER = "system:dpserve:kube-router"
# Its informer factory starts informers for all of these, whether or not the firewall
# reads them; a denied list would hold its cache sync (and so its start) forever.
_READ = [
    ("", ["pods", "namespaces", "nodes", "services", "endpoints"]),
    ("discovery.k8s.io", ["endpointslices"]),
    ("networking.k8s.io", ["networkpolicies"]),
]
# Present once the controller has synced the first time (its top-level chain, with
# the jump from FORWARD to it).
READY_CHAIN = "KUBE-ROUTER-FORWARD"


def rbac() -> list[dict[str, Any]]:
    """The ClusterRole and binding that let the engine's user read what it watches."""
    role: dict[str, Any] = {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "ClusterRole",
        "metadata": {"name": "dpserve:kube-router"},
        "rules": [
            {"apiGroups": [group], "resources": resources, "verbs": ["get", "list", "watch"]}
            for group, resources in _READ
        ],
    }
    binding: dict[str, Any] = {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "ClusterRoleBinding",
        "metadata": {"name": "dpserve:kube-router"},
        "roleRef": {
            "apiGroup": "rbac.authorization.k8s.io",
            "kind": "ClusterRole",
            "name": "dpserve:kube-router",
        },
        "subjects": [{"apiGroup": "rbac.authorization.k8s.io", "kind": "User", "name": USER}],
    }
    return [role, binding]


def arguments(
    *, kubeconfig: Path, node_name: str, service_cidr: str, health_port: int
) -> list[str]:
    """kube-router's command line: the firewall alone, for this node."""
    return [
        f"--kubeconfig={kubeconfig}",
        f"--hostname-override={node_name}",
        "--run-firewall=true",
        "--run-router=false",
        "--run-service-proxy=false",
        "--run-loadbalancer=false",
        # Traffic to Service IPs is let through to kube-proxy's DNAT; the pod's own
        # policy then applies to the translated packet.
        f"--service-cluster-ip-range={service_cidr}",
        f"--health-port={health_port}",
        "--metrics-port=0",
        # Its periodic full resync; policy and pod changes apply at once regardless.
        "--iptables-sync-period=1m",
    ]


@dataclass
class PolicyEngine:
    """kube-router's firewall for one node, started after the node is Ready (it reads
    the Node's InternalIP to tell its own pods from others)."""

    plane: ControlPlane
    binary: Path
    run_dir: Path
    node_name: str
    service_cidr: str
    daemon: Daemon | None = field(default=None, repr=False)

    def start(self, timeout_s: float = 60) -> PolicyEngine:
        self.plane.kubectl(
            "apply",
            "-f",
            "-",
            input=json.dumps({"apiVersion": "v1", "kind": "List", "items": rbac()}),
        )
        kubeconfig = self.plane.client_kubeconfig(NAME, f"/CN={USER}")
        (health_port,) = free_ports(1)
        self.daemon = Daemon(
            NAME,
            [
                str(self.binary),
                *arguments(
                    kubeconfig=kubeconfig,
                    node_name=self.node_name,
                    service_cidr=self.service_cidr,
                    health_port=health_port,
                ),
            ],
            self.run_dir / f"{NAME}.log",
            self.run_dir / f"{NAME}.pid",
        ).start()
        deadline = time.monotonic() + timeout_s
        while not _has_chain(READY_CHAIN):
            if self.daemon.exited() is not None:
                raise RuntimeError(f"{NAME} exited: {self.daemon.log_tail()}")
            if time.monotonic() > deadline:
                tail = self.daemon.log_tail()
                raise TimeoutError(f"{NAME}: no first sync in {timeout_s}s\n{tail}")
            time.sleep(0.2)
        return self

    def stop(self) -> None:
        """Stops the process; its rules and sets go with the node's host cleanup."""
        if self.daemon is not None:
            self.daemon.stop()
            self.daemon = None


def _has_chain(chain: str) -> bool:
    proc = subprocess.run(
        ["iptables", "-w", "-t", "filter", "-S", "FORWARD"],
        capture_output=True,
        text=True,
        check=False,
    )
    return f"-j {chain}" in proc.stdout
