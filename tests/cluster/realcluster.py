"""A one-node Kubernetes cluster of real parts: control plane, kubelet, containerd, kube-proxy.

Composed as ``localcluster.py`` composes the test kubelet's cluster: the bridge
comes first so the apiserver can bind its gateway address; pods reach it there
(through the ``kubernetes`` Service, whose endpoint the apiserver publishes) and the
host does too. Its own subnet and bridge (``10.245.0.0/24`` on ``dpnbr0``), so a
``LocalCluster`` (``10.244.0.0/24``) can run in the same session. Torn down in
reverse: node (pods, runtime, host state), control plane, bridge.
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
from tests.cluster.node import RUN_DIR, RealNode

HERE = Path(__file__).resolve().parent
POD_CIDR = "10.245.0.0/24"
PREFIX = "dpn"  # the bridge is dpnbr0
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


@dataclass
class RealCluster(OnPlane):
    network: TestNetwork
    plane: ControlPlane | None = None
    _node: RealNode | None = field(default=None, repr=False)

    @classmethod
    def start(cls, node_name: str = "node-1") -> RealCluster:
        install_node_deps()
        cluster = cls(network=TestNetwork(POD_CIDR, prefix=PREFIX))
        try:
            bin = build_binaries()
            cluster.network.start()  # its lock makes this the only real cluster now
            _end_recorded_plane()
            cluster.plane = ControlPlane(
                bin,
                api_host=cluster.network.gateway,
                endpoint_reconciler="lease",
                kubelet_client=True,
            )
            PLANE_RECORDS.mkdir(parents=True)
            (PLANE_RECORDS / "root").write_text(str(cluster.plane.root))
            try:
                cluster.plane.start()
            finally:
                for i, (name, proc) in enumerate(cluster.plane.procs.items()):
                    record(PLANE_RECORDS / f"{i}-{name}.pid", proc.pid)
            cluster._node = RealNode(
                cluster.plane,
                bin,
                bridge=cluster.network.bridge,
                node_ip=cluster.network.gateway,
                pod_cidr=POD_CIDR,
                name=node_name,
            ).start()
        except BaseException:
            cluster.stop()
            raise
        return cluster

    @property
    def node(self) -> RealNode:
        assert self._node is not None, "the cluster is not running"
        return self._node

    def stop(self) -> None:
        try:
            if self._node is not None:
                self._node.stop()
        finally:
            try:
                if self.plane is not None:
                    self.plane.stop()
                    shutil.rmtree(PLANE_RECORDS, ignore_errors=True)
            finally:
                self.network.stop()


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


def leftovers(run_dir: Path = RUN_DIR) -> list[str]:
    """What a stopped real cluster would have left on this machine (empty when clean)."""
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
            exe.startswith("containerd") and str(run_dir) in joined  # containerd and shims
        )
        if ours:
            found.append(f"process {pid_dir.name}: {joined}")
    found += [f"process {pid} in a pod cgroup" for pid in sorted(hoststate.kubepods_processes())]
    found += [f"cgroup {g}" for g in hoststate.kubepods_cgroups()]
    found += [f"mount {m}" for m in hoststate.mounts_under(run_dir)]
    found += [f"iptables {r}" for r in hoststate.node_rules()]
    found += [f"ipset {s}" for s in hoststate.node_ipsets()]
    if Path(f"/sys/class/net/{PREFIX}br0").exists():
        found.append(f"bridge {PREFIX}br0")
    if run_dir.exists():
        found.append(f"directory {run_dir}")
    found += [f"file {f}" for f in fixed_path_leftovers(run_dir)]
    if PLANE_RECORDS.exists():
        found.append(f"directory {PLANE_RECORDS}")
    return found
