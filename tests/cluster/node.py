"""A real Kubernetes node on this machine: kubelet, containerd + runc + CNI, kube-proxy,
and a NetworkPolicy engine (``policy.py``: kube-router's firewall).

The kubelet and kube-proxy are the real ones, built by ``build.sh`` from the same
``k8s.io/kubernetes`` module as the control plane. Pods run through the node's own
containerd (``containerd.py``) and runc, on the bridge the harness made first (the
apiserver listens on its gateway address, which is also this node's InternalIP),
with addresses from ``cni.py``'s network. kube-proxy (iptables mode) gives Services
their cluster IPs, on the host and in pods. The Node advertises ``nvidia.com/gpu``
as an extended resource, so GPU requests schedule (a container finds no GPU).

Credentials are a node's: the kubelet's client cert is ``system:node:<name>`` in
``system:nodes`` (the apiserver's Node authorizer and NodeRestriction apply);
kube-proxy's is ``system:kube-proxy``, bound to ``system:node-proxier`` by the
apiserver's bootstrap policy.

Everything the node writes lives in one fixed run directory (``RUN_DIR``): the
kubelet's root and pod logs, containerd's socket and state, pid files. Fixed, so a
start after a killed run finds its leftovers (processes by pid file, containers
through containerd, mounts, cgroups, iptables chains) and removes them; one node at
a time (a lock). Only containerd's root, with the images it holds, stays between
runs, in the cache.

What this machine (a Firecracker VM, kernel 6.x, cgroup v1 hybrid) allows, as
measured: root lacks CAP_SYS_RESOURCE, so no process may lower its oom_score_adj or
raise a hard rlimit. runc then fails every sandbox (the kubelet asks -998), hence
containerd's ``restrict_oom_score_adj``; the kubelet's own attempts only log errors.
cAdvisor, the OOM watcher on /dev/kmsg, cgroupfs on the v1 hierarchies, overlayfs,
br_netfilter, iptables (nf_tables backend) and veths all work as on a server.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import signal
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from dpserve.plumbing.ports import free_ports
from tests.cluster import cni, hoststate
from tests.cluster.containerd import Containerd
from tests.cluster.controlplane import SERVICE_CIDR, ControlPlane
from tests.cluster.daemon import Daemon
from tests.cluster.images import PAUSE_REF, pause_image
from tests.cluster.leftovers import clean_host, clean_leftovers, cni_teardown, kill_shims
from tests.cluster.nodeconfig import kube_proxy_config, kubelet_config
from tests.cluster.nodelayout import cgroup_top
from tests.cluster.policy import PolicyEngine

RUN_DIR = Path(os.environ.get("DPSERVE_NODE_DIR", "/var/lib/dpserve-node"))
CACHE = Path(os.environ.get("DPSERVE_CACHE", Path.home() / ".cache" / "dpserve")) / "node"
GPU_RESOURCE = "nvidia.com/gpu"


class NodeError(RuntimeError):
    pass


@dataclass
class RealNode:
    plane: ControlPlane
    bin: Path
    bridge: str
    node_ip: str  # the bridge's gateway: the host's address, every node's (nodelayout.py)
    pod_cidr: str
    name: str = "node-1"
    gpus: int = 4
    run_dir: Path = RUN_DIR
    cache: Path = CACHE
    # A node beside the first (nodelayout.py): its own pod cgroup root and pod
    # addresses; host_owner False leaves kube-proxy and host-wide state to the first.
    cgroup_root: str | None = None
    ip_range: tuple[str, str] | None = None
    host_owner: bool = True
    containerd: Containerd | None = None
    policy: PolicyEngine | None = None
    daemons: dict[str, Daemon] = field(default_factory=dict)
    _lock_fd: int | None = field(default=None, repr=False)
    _forward_was_off: bool = field(default=False, repr=False)

    # ------------------------------------------------------------------ lifecycle

    def start(self, timeout_s: float = 120) -> RealNode:
        self._lock()
        try:
            self._clean_leftovers()
            self.run_dir.mkdir(parents=True)
            if self.host_owner:
                self._forward_was_off = hoststate.enable_ip_forward()
                hoststate.allow_forwarding(self.bridge)
            if self.cgroup_root is not None:
                hoststate.make_cgroup_root(self._cgroup_top)
            self._write_cni()
            self.containerd = self._containerd().start()
            with tempfile.TemporaryFile() as archive:
                pause_image(archive)
                archive.seek(0)
                self.containerd.import_image(archive)
            self._start_kubelet()
            self._wait_node_ready(timeout_s)
            self._advertise_gpus()
            # The others share its network namespace: one kube-proxy, and one policy
            # engine (two would remove each other's pod chains), both on this node. The
            # engine guards the pods whose hostIP is this node's address: every node's.
            if self.host_owner:
                self._start_kube_proxy(timeout_s)
                self.policy = PolicyEngine(
                    self.plane, self.bin / "kube-router", self.run_dir, self.name, SERVICE_CIDR
                )
                self.policy.start(timeout_s)
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        """Stop everything and leave nothing: processes, mounts, cgroups, rules, dirs.

        The kubelet goes first, so it starts and restarts nothing more; its pods are
        then removed through containerd (no grace: the cluster is going away)."""
        try:
            if self.policy is not None:
                self.policy.stop()
                self.policy = None
            for name in ("kube-proxy", "kubelet"):
                if name in self.daemons:
                    self.daemons.pop(name).stop()
            if self.containerd is not None and self.containerd.daemon is not None:
                try:
                    if self.containerd.daemon.exited() is None:
                        self.containerd.remove_all_containers(self._cni_teardown)
                finally:
                    self.containerd.stop()
        finally:
            try:
                # Also what a failed step above left.
                clean_host(self.run_dir, self.bin, self._cgroup_top, self.host_owner)
                if self._forward_was_off:
                    hoststate.disable_ip_forward()
                    self._forward_was_off = False
            finally:
                self._unlock()

    def lose(self) -> None:
        """The node lost, as in a power cut: its kubelet, containerd, shims and pods are
        killed at once and nothing is told or cleaned (``stop()`` cleans up later). The
        first node's kube-proxy stays: it serves this host's one network namespace, as
        the other nodes' kube-proxies would in a cluster of machines."""
        runtime = self.containerd.daemon if self.containerd is not None else None
        # Out of `daemons`: what waits on this node (wait_routed) waits on what still runs.
        for daemon in (self.daemons.pop("kubelet", None), runtime):
            if daemon is not None:
                daemon.kill()
        kill_shims(self.run_dir / "containerd")
        for pid in hoststate.kubepods_processes(self._cgroup_top):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)

    def clean_leftovers(self) -> None:
        """What a killed run left of this node, for a node this run does not start."""
        self._lock()
        try:
            self._clean_leftovers()
        finally:
            self._unlock()

    def _clean_leftovers(self) -> None:
        clean_leftovers(
            self.run_dir, self._containerd(), self.bin, self._cgroup_top, self.host_owner
        )

    @property
    def _cgroup_top(self) -> str:
        return cgroup_top(self.cgroup_root)

    def _containerd(self) -> Containerd:
        return Containerd(self.run_dir, self.cache / "containerd", sandbox_image=PAUSE_REF)

    def _lock(self) -> None:
        lock_dir = Path("/run/lock") if os.access("/run/lock", os.W_OK) else Path("/tmp")
        # One lock per run directory: node-2 beside node-1 is fine, two node-1s are not.
        fd = os.open(lock_dir / f"{self.run_dir.name}.lock", os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise NodeError(f"another real test node uses {self.run_dir} on this machine") from None
        self._lock_fd = fd

    def _unlock(self) -> None:
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None

    # ------------------------------------------------------------------ parts

    def _write_cni(self) -> None:
        assert self.run_dir.is_dir()
        conf_dir = self._containerd().cni_conf_dir
        conf_dir.mkdir(parents=True)
        config = cni.conflist(
            self.bridge,
            self.pod_cidr,
            self.node_ip,
            self.run_dir / "cni" / "ipam",
            self.ip_range,
        )
        (conf_dir / "10-dpserve.conflist").write_text(json.dumps(config, indent=2))

    def _cni_teardown(self, sandbox_id: str, netns: str | None) -> None:
        cni_teardown(self.run_dir, sandbox_id, netns)

    def _start_kubelet(self) -> None:
        assert self.containerd is not None
        port, healthz = free_ports(2)
        config = self.run_dir / "kubelet.yaml"
        config.write_text(
            json.dumps(
                kubelet_config(
                    node_ip=self.node_ip,
                    port=port,
                    healthz_port=healthz,
                    ca_file=self.plane.pki / "ca.crt",
                    runtime_socket=self.containerd.socket,
                    pod_logs=self.run_dir / "pod-logs",
                    cgroup_root=self.cgroup_root,
                ),
                indent=2,
            )
        )
        # Named by node: each kubelet has its own identity (and files) on the plane.
        kubeconfig = self.plane.client_kubeconfig(
            f"kubelet-{self.name}", f"/O=system:nodes/CN=system:node:{self.name}"
        )
        self._spawn(
            "kubelet",
            [
                f"--config={config}",
                f"--kubeconfig={kubeconfig}",
                f"--root-dir={self.run_dir / 'kubelet'}",
                # Its self-signed serving cert (default /var/lib/kubelet/pki).
                f"--cert-dir={self.run_dir / 'kubelet' / 'pki'}",
                f"--hostname-override={self.name}",
                f"--node-ip={self.node_ip}",
            ],
        )

    def _start_kube_proxy(self, timeout_s: float) -> None:
        healthz, metrics = free_ports(2)
        kubeconfig = self.plane.client_kubeconfig("kube-proxy", "/CN=system:kube-proxy")
        config = self.run_dir / "kube-proxy.yaml"
        config.write_text(
            json.dumps(
                kube_proxy_config(
                    kubeconfig=kubeconfig,
                    node_name=self.name,
                    cluster_cidr=self.pod_cidr,
                    healthz_port=healthz,
                    metrics_port=metrics,
                ),
                indent=2,
            )
        )
        self._spawn("kube-proxy", [f"--config={config}"])
        # Ready once the `kubernetes` Service (its endpoint is the apiserver) is in
        # the NAT rules: proof of a first full sync with real endpoints.
        ip = self.plane.kubectl(
            "get", "service", "kubernetes", "-o", "jsonpath={.spec.clusterIP}"
        ).stdout
        self._until(
            timeout_s,
            "kube-proxy's first sync",
            lambda: f"{ip}/32" in _nat_services(),
        )

    def wait_routed(self, service_ip: str, timeout_s: float = 30) -> None:
        """Until kube-proxy has a NAT rule for ``service_ip`` (it writes one only once the
        Service has ready endpoints). Before that, a request to the IP leaves through the
        default route, and this sandbox's egress proxy answers any port-80 request with
        an empty 404: a wrong answer, not an error a caller would retry."""
        self._until(
            timeout_s,
            f"kube-proxy's rule for {service_ip}",
            lambda: f"{service_ip}/32" in _nat_services(),
        )

    def _spawn(self, name: str, args: list[str]) -> None:
        self.daemons[name] = Daemon(
            name,
            [str(self.bin / name), *args],
            self.run_dir / f"{name}.log",
            self.run_dir / f"{name}.pid",
        ).start()

    def _wait_node_ready(self, timeout_s: float) -> None:
        def ready() -> bool:
            got = self.plane.kubectl("get", "node", self.name, "-o", "json", check=False)
            if got.returncode != 0:
                return False
            conditions = json.loads(got.stdout)["status"].get("conditions", [])
            return any(c["type"] == "Ready" and c["status"] == "True" for c in conditions)

        self._until(timeout_s, f"node {self.name} Ready", ready)

    def _advertise_gpus(self) -> None:
        """``nvidia.com/gpu`` in the Node's capacity, as a device plugin would put it;
        allocatable too, so the scheduler sees it before the kubelet's next status."""
        path = GPU_RESOURCE.replace("/", "~1")  # JSON Pointer escaping
        patch = [
            {"op": "add", "path": f"/status/capacity/{path}", "value": str(self.gpus)},
            {"op": "add", "path": f"/status/allocatable/{path}", "value": str(self.gpus)},
        ]
        self.plane.kubectl(
            "patch",
            "node",
            self.name,
            "--subresource=status",
            "--type=json",
            f"--patch={json.dumps(patch)}",
        )

    def _until(self, timeout_s: float, what: str, check: Any) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            for daemon in self.daemons.values():
                if daemon.exited() is not None:
                    raise NodeError(f"{daemon.name} exited: {daemon.log_tail()}")
            if check():
                return
            time.sleep(0.2)
        tails = "\n".join(f"--- {d.name}\n{d.log_tail()}" for d in self.daemons.values())
        raise TimeoutError(f"{what}: not in {timeout_s}s\n{tails}")

    # ------------------------------------------------------------------ images

    def import_image(self, archive: IO[bytes] | Path) -> None:
        """A docker-save or OCI archive (stream or file) into CRI's image store."""
        assert self.containerd is not None, "the node is not running"
        self.containerd.import_image(archive)

    def pull_image(self, source: str, name: str) -> None:
        """Image ``source`` from a plain-HTTP registry into CRI's store, as ``name``."""
        assert self.containerd is not None, "the node is not running"
        self.containerd.pull_image(source, name)

    def image_id(self, ref: str) -> str | None:
        """``sha256:<config digest>`` of image ``ref`` (``name:tag``), None if absent."""
        assert self.containerd is not None, "the node is not running"
        return self.containerd.image_id(ref)

    def remove_image(self, ref: str) -> None:
        assert self.containerd is not None, "the node is not running"
        self.containerd.remove_image(ref)


def _nat_services() -> str:
    proc = subprocess.run(
        ["iptables", "-w", "-t", "nat", "-S", "KUBE-SERVICES"],
        capture_output=True,
        text=True,
        check=False,
    )
    return proc.stdout
