"""A test pod network on this machine: one Linux bridge, a network namespace per pod.

Test double for a CNI plugin. ``TestNetwork.start()`` makes a bridge (``dpsbr0``)
holding the gateway address (``10.244.0.1/24`` by default); ``add_pod()`` makes a
network namespace with a veth pair whose inside end is ``eth0`` with the next free
address of the subnet, loopback up, and a default route via the gateway. The host
reaches every pod over the bridge (the subnet is on-link), and a process bound to
the gateway address (the test apiserver) is reachable from every pod.

Traffic stays on this machine: no NAT, no forwarding is switched on, so a pod's
default route ends at the host, which does not route it anywhere else.

Every name starts with the prefix (``dps`` by default): ``stop()`` removes what this
object made, and ``start()`` first removes leftovers with the prefix from a crashed
run. A lock file keeps two live networks from sharing one prefix. Needs root and
``ip`` (iproute2).
"""

from __future__ import annotations

import contextlib
import fcntl
import ipaddress
import os
import signal
import subprocess
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path

IP = "ip"


class NetworkError(RuntimeError):
    pass


def _ip(*args: str, input: str | None = None, check: bool = True) -> str:
    proc = subprocess.run([IP, *args], input=input, capture_output=True, text=True)
    if check and proc.returncode != 0:
        detail = (proc.stderr or proc.stdout).strip()
        raise NetworkError(f"ip {' '.join(args)}: {detail}")
    return proc.stdout


def _batch(commands: list[str], netns: str | None = None) -> None:
    """Run many ``ip`` commands in one process (stops at the first error)."""
    pre = ["-n", netns] if netns else []
    _ip(*pre, "-batch", "-", input="\n".join(commands) + "\n")


def available() -> str | None:
    """Why a test network cannot be made here, or None when it can."""
    if os.geteuid() != 0:
        return "the test network needs root (network namespaces, a bridge)"
    try:
        _ip("netns", "list")
    except (OSError, NetworkError) as e:
        return f"ip netns is unavailable: {e}"
    return None


@dataclass(frozen=True)
class PodNetwork:
    """One pod's slice of the network: its namespace (None without one) and address."""

    ip: str
    netns: str | None
    host_veth: str | None

    @property
    def netns_path(self) -> str | None:
        return f"/run/netns/{self.netns}" if self.netns else None


class TestNetwork:
    """A bridge plus per-pod namespaces, all named with ``prefix``."""

    __test__ = False  # not a pytest test class

    def __init__(self, cidr: str = "10.244.0.0/24", prefix: str = "dps") -> None:
        if not prefix.isalnum() or len(prefix) > 6:
            raise ValueError("prefix: up to 6 letters or digits (interface names are short)")
        self.subnet = ipaddress.ip_network(cidr)
        if self.subnet.version != 4 or self.subnet.num_addresses < 4:
            raise ValueError(f"need an IPv4 subnet with room for pods: {cidr}")
        self.prefix = prefix
        self.bridge = f"{prefix}br0"
        self.gateway = str(self.subnet.network_address + 1)
        self._hosts = list(self.subnet.hosts())[1:]  # the first host is the gateway
        self._used: set[str] = set()
        self._next = 0  # round-robin, as host-local IPAM: a freed address is not reused at once
        self._pods: dict[str, PodNetwork] = {}
        self._lock = threading.Lock()
        self._lockfile: int | None = None
        self.started = False

    @property
    def prefixlen(self) -> int:
        return self.subnet.prefixlen

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> TestNetwork:
        lock_dir = (
            Path("/run/lock") if os.access("/run/lock", os.W_OK) else Path(tempfile.gettempdir())
        )
        fd = os.open(lock_dir / f"dpserve-net-{self.prefix}.lock", os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise NetworkError(
                f"another test network with prefix {self.prefix!r} is live on this machine"
            ) from None
        self._lockfile = fd
        try:
            self.cleanup_stale()
            # A fixed MAC: a bridge otherwise takes the lowest MAC of its ports, which
            # changes as pods come and go and leaves pods' neighbour caches stale.
            _batch(
                [
                    f"link add {self.bridge} type bridge stp_state 0",
                    f"link set {self.bridge} address 02:64:70:73:00:01",
                    f"addr add {self.gateway}/{self.prefixlen} dev {self.bridge}",
                    f"link set {self.bridge} up",
                ]
            )
        except BaseException:
            self.stop()
            raise
        self.started = True
        return self

    def cleanup_stale(self) -> None:
        """Remove namespaces and links with this prefix (left by a crashed run)."""
        for line in _ip("netns", "list").splitlines():
            name = line.split()[0] if line.split() else ""
            if name.startswith(f"{self.prefix}-pod-"):
                _kill_and_delete_netns(name)  # a crashed run's processes die with it
        for line in _ip("-o", "link", "show").splitlines():
            # "12: dpsv3@if2: <...>" -> "dpsv3"
            parts = line.split(":", 2)
            if len(parts) < 2:
                continue
            name = parts[1].strip().split("@")[0]
            if name == self.bridge or (
                name.startswith(f"{self.prefix}v") and name[len(self.prefix) + 1 :].isdigit()
            ):
                _ip("link", "del", name, check=False)

    def stop(self) -> None:
        if self._lockfile is None:  # never started (or another run owns the prefix)
            return
        with self._lock:
            pods = list(self._pods.values())
        for pod in pods:
            self.remove_pod(pod)
        _ip("link", "del", self.bridge, check=False)
        self.cleanup_stale()
        if self._lockfile is not None:
            os.close(self._lockfile)  # releases the flock
            self._lockfile = None
        self.started = False

    # ------------------------------------------------------------------ addresses

    def allocate_ip(self) -> str:
        with self._lock:
            for step in range(len(self._hosts)):
                i = (self._next + step) % len(self._hosts)
                ip = str(self._hosts[i])
                if ip not in self._used:
                    self._used.add(ip)
                    self._next = i + 1
                    return ip
        raise NetworkError(f"no free address left in {self.subnet}")

    @property
    def allocated(self) -> frozenset[str]:
        """Addresses in use now (pods with or without a namespace)."""
        with self._lock:
            return frozenset(self._used)

    def release_ip(self, ip: str) -> None:
        with self._lock:
            self._used.discard(ip)

    def _index(self, ip: str) -> int:
        return int(ipaddress.ip_address(ip)) - int(self.subnet.network_address)

    # ------------------------------------------------------------------ pods

    def add_pod(self, with_netns: bool = True) -> PodNetwork:
        """A fresh address, and (by default) a namespace with ``eth0`` holding it."""
        ip = self.allocate_ip()
        if not with_netns:
            return PodNetwork(ip=ip, netns=None, host_veth=None)
        n = self._index(ip)
        pod = PodNetwork(ip=ip, netns=f"{self.prefix}-pod-{n}", host_veth=f"{self.prefix}v{n}")
        try:
            _batch(
                [
                    f"netns add {pod.netns}",
                    f"link add {pod.host_veth} type veth peer name eth0 netns {pod.netns}",
                    f"link set {pod.host_veth} master {self.bridge} up",
                ]
            )
            _batch(
                [
                    "link set lo up",
                    f"addr add {ip}/{self.prefixlen} dev eth0",
                    "link set eth0 up",
                    f"route add default via {self.gateway} dev eth0",
                ],
                netns=pod.netns,
            )
        except BaseException:
            self._teardown(pod)
            self.release_ip(ip)
            raise
        with self._lock:
            self._pods[ip] = pod
        return pod

    def pids(self, pod: PodNetwork) -> list[int]:
        """Processes living in the pod's namespace."""
        if not pod.netns:
            return []
        out = _ip("netns", "pids", pod.netns, check=False)
        return [int(p) for p in out.split() if p.isdigit()]

    def remove_pod(self, pod: PodNetwork) -> None:
        """Kill whatever still runs in the pod's namespace, delete it, free the address."""
        self._teardown(pod)
        with self._lock:
            self._pods.pop(pod.ip, None)
        self.release_ip(pod.ip)

    def _teardown(self, pod: PodNetwork) -> None:
        if pod.host_veth:
            _ip("link", "del", pod.host_veth, check=False)
        if pod.netns:
            _kill_and_delete_netns(pod.netns)


def _kill_and_delete_netns(name: str) -> None:
    """Deleting a namespace only unnames it: what still runs inside is killed first."""
    for pid in _ip("netns", "pids", name, check=False).split():
        with contextlib.suppress(ProcessLookupError, ValueError):
            os.kill(int(pid), signal.SIGKILL)
    _ip("netns", "del", name, check=False)
