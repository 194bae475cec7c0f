"""What the test node changes on this machine outside its own directories, and undoing it.

Mounts (pod volumes, network namespaces, container root file systems), cgroups
(the kubelet's ``kubepods`` tree, cgroupfs driver), iptables (the node's FORWARD
rules for its bridge, and the ``KUBE-*`` chains of the kubelet, kube-proxy and the
policy engine), ipsets (the policy engine's ``KUBE-*`` sets) and the ``ip_forward``
switch. Each undo is idempotent, so the same calls clean up
after a run that was killed before it could stop.
"""

from __future__ import annotations

import contextlib
import os
import re
import shlex
import signal
import subprocess
import time
from pathlib import Path

CGROUP_ROOT = Path("/sys/fs/cgroup")
KUBEPODS = "kubepods"  # the kubelet's pod cgroup tree (cgroupfs driver)
IP_FORWARD = Path("/proc/sys/net/ipv4/ip_forward")
COMMENT = "dpserve-node"  # marks the iptables rules this module adds


# ---------------------------------------------------------------------- mounts


def mounts_under(path: Path) -> list[str]:
    """Mount points at or below ``path``, deepest first."""
    prefix = str(path).rstrip("/")
    found = []
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        # Field 5 is the mount point, with spaces and the like octal-escaped.
        point = re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), line.split()[4])
        if point == prefix or point.startswith(prefix + "/"):
            found.append(point)
    return sorted(set(found), key=lambda p: p.count("/"), reverse=True)


def unmount_under(path: Path) -> None:
    # Lazy: a mount still in use by a dying process is detached now, freed later.
    for point in mounts_under(path):
        subprocess.run(["umount", "--lazy", point], capture_output=True, check=False)


# ---------------------------------------------------------------------- cgroups


def make_cgroup_root(top: str) -> None:
    """Cgroup ``/<top>`` in every hierarchy, for a kubelet's ``cgroupRoot`` (it refuses
    to start unless the root exists in each). cpuset gets its parent's CPUs and memory
    nodes: v1 leaves them empty, and no process could join a cgroup below it."""
    for hierarchy in _hierarchies():
        group = hierarchy / top
        group.mkdir(exist_ok=True)
        for name in ("cpuset.cpus", "cpuset.mems"):
            if (hierarchy / name).exists() and not (group / name).read_text().strip():
                (group / name).write_text((hierarchy / name).read_text())


def _hierarchies() -> list[Path]:
    if not CGROUP_ROOT.is_dir():
        return []
    return [h for h in CGROUP_ROOT.iterdir() if h.is_dir() and not h.is_symlink()]


def kubepods_cgroups(top: str = KUBEPODS) -> list[Path]:
    """Every cgroup of the tree ``/<top>`` (a node's pods) in every hierarchy, deepest first."""
    found: list[Path] = []
    for hierarchy in _hierarchies():
        if (hierarchy / top).is_dir():
            found += [Path(d) for d, _, _ in os.walk(hierarchy / top)]
    return sorted(found, key=lambda p: len(p.parts), reverse=True)


def kubepods_processes(top: str = KUBEPODS) -> set[int]:
    pids: set[int] = set()
    for group in kubepods_cgroups(top):
        with contextlib.suppress(OSError):
            pids |= {int(p) for p in (group / "cgroup.procs").read_text().split()}
    return pids


def remove_kubepods(top: str = KUBEPODS) -> None:
    """Kill what still runs in pod cgroups (container processes whose runtime is gone),
    then remove the cgroups, leaves first (``top`` itself too)."""
    for pid in kubepods_processes(top):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    for group in kubepods_cgroups(top):
        for _ in range(50):  # a killed process leaves its cgroup a moment later
            try:
                group.rmdir()
                break
            except FileNotFoundError:
                break
            except OSError:
                time.sleep(0.05)


# ---------------------------------------------------------------------- iptables


def _iptables(binary: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([binary, "-w", *args], capture_output=True, text=True, check=False)


def allow_forwarding(bridge: str) -> None:
    """ACCEPT the bridge's traffic in FORWARD (Docker sets that chain's policy to DROP)."""
    for direction in ("-i", "-o"):
        rule = [direction, bridge, "-m", "comment", "--comment", COMMENT, "-j", "ACCEPT"]
        if _iptables("iptables", "-C", "FORWARD", *rule).returncode != 0:
            _iptables("iptables", "-I", "FORWARD", "1", *rule)


def _save(binary: str) -> str:
    proc = subprocess.run([f"{binary}-save"], capture_output=True, text=True, check=False)
    return proc.stdout


def node_rules() -> list[str]:
    """What the node left in iptables: our rules (by comment), KUBE- chains, jumps to them."""
    return [
        f"{binary}: {line}"
        for binary in ("iptables", "ip6tables")
        for line in _save(binary).splitlines()
        if COMMENT in line or line.startswith(":KUBE-") or "-j KUBE-" in line
    ]


def remove_node_rules() -> None:
    """Delete our FORWARD rules and every KUBE- chain (the kubelet's KUBE-FIREWALL and
    canaries, whatever ``kube-proxy --cleanup`` left) with the jumps to them."""
    for binary in ("iptables", "ip6tables"):
        table = ""
        chains: list[tuple[str, str]] = []
        for line in _save(binary).splitlines():
            if line.startswith("*"):
                table = line[1:]
            elif line.startswith(":KUBE-"):
                chains.append((table, line[1:].split()[0]))
            elif line.startswith("-A ") and (COMMENT in line or "-j KUBE-" in line):
                args = shlex.split(line)  # ["-A", CHAIN, ...]; a comment may be quoted
                if not args[1].startswith("KUBE-"):  # rules inside KUBE- chains go with them
                    _iptables(binary, "-t", table, "-D", *args[1:])
        for table, chain in chains:  # flushed first: chains may jump to one another
            _iptables(binary, "-t", table, "-F", chain)
        for table, chain in chains:
            _iptables(binary, "-t", table, "-X", chain)


# ---------------------------------------------------------------------- ipsets

# The policy engine's (kube-router's) sets; "inet6:" prefixes its IPv6 twins.
IPSET_PREFIXES = ("KUBE-", "inet6:KUBE-")


def node_ipsets() -> list[str]:
    """The node's ipsets still present (none where the ipset tool is absent)."""
    try:
        proc = subprocess.run(["ipset", "list", "-n"], capture_output=True, text=True)
    except FileNotFoundError:
        return []
    return [name for name in proc.stdout.split() if name.startswith(IPSET_PREFIXES)]


def remove_node_ipsets() -> None:
    """Destroy the node's ipsets; after ``remove_node_rules``: a set in use by a rule
    cannot be destroyed."""
    for name in node_ipsets():
        subprocess.run(["ipset", "destroy", name], capture_output=True, check=False)


# ---------------------------------------------------------------------- sysctl


def enable_ip_forward() -> bool:
    """Turn IPv4 forwarding on; returns whether it was off (so ``stop`` turns it back)."""
    was_off = IP_FORWARD.read_text().strip() == "0"
    if was_off:
        IP_FORWARD.write_text("1\n")
    return was_off


def disable_ip_forward() -> None:
    IP_FORWARD.write_text("0\n")
