"""A Kubernetes cluster of real parts: control plane, kubelets, containerds, kube-proxy.

Composed as ``localcluster.py`` composes the test kubelet's cluster: the bridge
comes first so the apiserver can bind its gateway address; pods reach it there
(through the ``kubernetes`` Service, whose endpoint the apiserver publishes) and the
host does too. Its own subnet and bridge (``10.245.0.0/24`` on ``dpnbr0``), so a
``LocalCluster`` (``10.244.0.0/24``) can run in the same session. Torn down in
reverse: nodes (pods, runtime, host state), control plane, bridge.

One node by default; a second (``start(nodes=2)``, or ``add_node()`` on a running
cluster, which is how a test that needs it asks) shares this host's network
namespace and bridge, with its own kubelet, containerd, cgroup root and slice of
the pod addresses (``nodelayout.py``). One kube-proxy, the first node's, serves both.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

from tests.cluster import hoststate
from tests.cluster.controlplane import ControlPlane, OnPlane, build_binaries
from tests.cluster.daemon import kill_recorded, record
from tests.cluster.leftovers import fixed_path_leftovers
from tests.cluster.network import TestNetwork
from tests.cluster.network import available as network_available
from tests.cluster.node import CACHE, RUN_DIR, RealNode
from tests.cluster.nodelayout import MAX_NODES, NodeLayout, node_layout

HERE = Path(__file__).resolve().parent
POD_CIDR = "10.245.0.0/24"
PREFIX = "dpn"  # the bridge is dpnbr0
# A lost node is NotReady this long after its last heartbeat (Kubernetes 1.33's default
# is 50 s; the node-loss journey's figure scales with it). Its kubelets renew their
# Lease every 2 s (nodeconfig.py), so only a kubelet stalled 10 renewals in a row
# on these 2 busy cores would be taken for lost.
NODE_MONITOR_GRACE_S = 20
# The control plane's pid files and root, for a start after a killed run: the
# plane has no fixed paths of its own (a fresh temp root each time).
PLANE_RECORDS = RUN_DIR.with_name(RUN_DIR.name + "-plane")


def real_node_unavailable() -> str | None:
    """Why a real node cannot run on this machine, or None when it can."""
    reason = network_available()
    if reason:
        return reason
    cgroups = Path("/sys/fs/cgroup")
    if not ((cgroups / "memory").is_dir() or (cgroups / "cgroup.controllers").exists()):
        return "no cgroup memory controller mounted (the kubelet needs it)"
    if "overlay" not in Path("/proc/filesystems").read_text():
        return "no overlay file system (containerd's snapshotter)"
    if shutil.which("apt-get") is None and shutil.which("containerd") is None:
        return "containerd is missing and there is no apt-get to install it"
    if shutil.which("go") is None and not _binaries_cached():
        return "the kubelet is not built and there is no Go toolchain to build it"
    return None


def _binaries_cached() -> bool:
    try:
        return (build_binaries() / "kubelet").exists()
    except subprocess.CalledProcessError:
        return False


def install_node_deps() -> None:
    """Debian's containerd, runc, CNI plugins, iptables, busybox-static (when missing)."""
    subprocess.run(["bash", str(HERE / "node-deps.sh")], check=True)


def layouts(count: int = MAX_NODES) -> list[NodeLayout]:
    """The first ``count`` nodes' share of this machine (all that may exist by default)."""
    return [node_layout(i, POD_CIDR, RUN_DIR, CACHE) for i in range(count)]


@dataclass
class RealCluster(OnPlane):
    network: TestNetwork
    plane: ControlPlane | None = None
    bin: Path | None = None
    _nodes: list[RealNode] = field(default_factory=list, repr=False)

    @classmethod
    def start(cls, nodes: int = 1) -> RealCluster:
        install_node_deps()
        cluster = cls(network=TestNetwork(POD_CIDR, prefix=PREFIX))
        try:
            bin = cluster.bin = build_binaries()
            cluster.network.start()  # its lock makes this the only real cluster now
            _end_recorded_plane()
            cluster.plane = ControlPlane(
                bin,
                api_host=cluster.network.gateway,
                endpoint_reconciler="lease",
                kubelet_client=True,
                node_monitor_grace_s=NODE_MONITOR_GRACE_S,
            )
            PLANE_RECORDS.mkdir(parents=True)
            (PLANE_RECORDS / "root").write_text(str(cluster.plane.root))
            try:
                cluster.plane.start()
            finally:
                for i, (name, proc) in enumerate(cluster.plane.procs.items()):
                    record(PLANE_RECORDS / f"{i}-{name}.pid", proc.pid)
            # Nodes a killed run left beyond those this one starts (each node
            # started cleans up after its own predecessor).
            for layout in layouts()[nodes:]:
                cluster._node_for(layout).clean_leftovers()
            for _ in range(nodes):
                cluster.add_node()
        except BaseException:
            cluster.stop()
            raise
        return cluster

    @property
    def node(self) -> RealNode:
        """The first node (the one of a one-node cluster)."""
        assert self._nodes, "the cluster is not running"
        return self._nodes[0]

    @property
    def nodes(self) -> list[RealNode]:
        return list(self._nodes)

    def add_node(self) -> RealNode:
        """One more node, Ready, with the next layout (nodelayout.py)."""
        node = self._node_for(node_layout(len(self._nodes), POD_CIDR, RUN_DIR, CACHE))
        self._nodes.append(node.start())
        return node

    def ensure_nodes(self, count: int) -> list[RealNode]:
        """At least ``count`` nodes: the missing ones are added (a session's one-node
        cluster grows when a test needs two; ``shrink_to`` takes it back)."""
        while len(self._nodes) < count:
            self.add_node()
        return self.nodes

    def shrink_to(self, count: int) -> None:
        """Back to ``count`` nodes (at least the first): the newest stop and their Node
        objects leave the API, so the tests after one that needed more nodes see the
        cluster they were written for (one node's GPUs; the policy engine's node). A
        stopped node keeps its image cache: adding it again is seconds."""
        while len(self._nodes) > max(1, count):
            node = self._nodes.pop()
            try:
                node.stop()
            finally:
                self.kubectl("delete", "node", node.name, "--ignore-not-found", "--wait=false")

    def _node_for(self, layout: NodeLayout) -> RealNode:
        assert self.plane is not None and self.bin is not None, "the cluster is not running"
        return RealNode(
            self.plane,
            self.bin,
            bridge=self.network.bridge,
            node_ip=layout.node_ip,
            pod_cidr=POD_CIDR,
            name=layout.name,
            run_dir=layout.run_dir,
            cache=layout.cache,
            cgroup_root=layout.cgroup_root,
            ip_range=layout.ip_range,
            host_owner=layout.host_owner,
        )

    def stop(self) -> None:
        try:
            self._stop_nodes()
        finally:
            try:
                if self.plane is not None:
                    self.plane.stop()
                    shutil.rmtree(PLANE_RECORDS, ignore_errors=True)
            finally:
                self.network.stop()

    def _stop_nodes(self) -> None:
        """Newest first: the first node, owner of the host-wide state, goes last. Every
        node is stopped even when one fails to stop; the first failure is raised."""
        failure: BaseException | None = None
        while self._nodes:
            try:
                self._nodes.pop().stop()
            except BaseException as exc:  # raised below, once every node is stopped
                failure = failure or exc
        if failure is not None:
            raise failure


def _end_recorded_plane() -> None:
    """The control plane of a killed run: its processes (newest first) and its root."""
    if not PLANE_RECORDS.exists():
        return
    # Newest first, as ControlPlane.stop does: an apiserver outliving etcd retries.
    for pidfile in sorted(PLANE_RECORDS.glob("*.pid"), reverse=True):
        kill_recorded(pidfile)
    root = PLANE_RECORDS / "root"
    if root.exists():
        shutil.rmtree(root.read_text().strip(), ignore_errors=True)
    shutil.rmtree(PLANE_RECORDS)


def leftovers() -> list[str]:
    """What a stopped real cluster would have left on this machine (empty when clean):
    of every node that may exist (nodelayout.py), whether this run started it or not."""
    nodes = layouts()
    found: list[str] = []
    for pid_dir in Path("/proc").iterdir():
        if not pid_dir.name.isdigit():
            continue
        try:
            argv = (pid_dir / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        exe = os.path.basename(argv[0].decode(errors="replace"))
        joined = b" ".join(argv).decode(errors="replace")
        ours = (exe in ("kubelet", "kube-proxy", "kube-router") and "dpserve" in joined) or (
            exe.startswith("containerd")  # containerd and shims
            and any(str(n.run_dir) in joined for n in nodes)
        )
        if ours:
            found.append(f"process {pid_dir.name}: {joined}")
    for node in nodes:
        top = node.cgroup_top
        found += [f"process {p} in a pod cgroup" for p in sorted(hoststate.kubepods_processes(top))]
        found += [f"cgroup {g}" for g in hoststate.kubepods_cgroups(top)]
        found += [f"mount {m}" for m in hoststate.mounts_under(node.run_dir)]
        if node.run_dir.exists():
            found.append(f"directory {node.run_dir}")
        found += [f"file {f}" for f in fixed_path_leftovers(node.run_dir)]
    found += [f"iptables {r}" for r in hoststate.node_rules()]
    found += [f"ipset {s}" for s in hoststate.node_ipsets()]
    if Path(f"/sys/class/net/{PREFIX}br0").exists():
        found.append(f"bridge {PREFIX}br0")
    if PLANE_RECORDS.exists():
        found.append(f"directory {PLANE_RECORDS}")
    return list(dict.fromkeys(found))  # the shared fixed paths show once, not per node
