"""What a real test node leaves on this machine, found and removed.

Used at stop, and at start after a run that was killed before it could stop: the
node's daemons (by pid file), its containers (through a containerd on the same
state, which finds the surviving shims), then the host (``hoststate.py``) and the
fixed paths outside the run directory that the kubelet and the CRI plugin write.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
from pathlib import Path

from tests.cluster import cni, hoststate
from tests.cluster.containerd import Containerd
from tests.cluster.daemon import kill_recorded

# Fixed paths outside the run directory that the kubelet and CRI write to:
CONTAINER_LOGS = Path("/var/log/containers")  # the kubelet's symlinks to pod logs
DEVICE_PLUGINS = Path("/var/lib/kubelet/device-plugins")  # the kubelet's socket, checkpoint
CNI_CACHE = Path("/var/lib/cni/results")  # libcni's record of each sandbox's ADD


def cni_teardown(run_dir: Path, sandbox_id: str, netns: str | None) -> None:
    for conf in sorted((run_dir / "cni" / "net.d").glob("*.conflist")):
        cni.teardown(json.loads(conf.read_text()), sandbox_id, netns)
    # What libcni cached of this sandbox's ADD (its own DEL would have removed it).
    for cached in CNI_CACHE.glob(f"*-{sandbox_id}-*"):
        cached.unlink(missing_ok=True)


def clean_leftovers(
    run_dir: Path,
    containerd: Containerd,
    bin: Path,
    cgroup_top: str = hoststate.KUBEPODS,
    host: bool = True,
) -> None:
    """Undo what a killed run left: its daemons (by pid file), its containers (through
    a containerd on the same state, which finds the surviving shims), then the host."""
    if not run_dir.exists():
        clean_host(run_dir, bin, cgroup_top, host)
        return
    for name in ("kube-router", "kube-proxy", "kubelet", "containerd"):
        kill_recorded(run_dir / f"{name}.pid")
    if containerd.state.exists():
        with contextlib.suppress(RuntimeError, TimeoutError, OSError):
            containerd.start()
            containerd.remove_all_containers(lambda sid, ns: cni_teardown(run_dir, sid, ns))
        containerd.stop()
    clean_host(run_dir, bin, cgroup_top, host)


def kill_shims(state: Path) -> None:
    """Shims that no containerd could reach, by their pid files (their containers'
    processes go with the pod cgroups). A pid counts only while it is still a shim
    of that container: pids are reused."""
    for pidfile in (state / "io.containerd.runtime.v2.task").glob("*/*/shim.pid"):
        with contextlib.suppress(OSError, ValueError):
            pid = int(pidfile.read_text().strip())
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            if b"containerd-shim" in cmdline[0] and pidfile.parent.name.encode() in cmdline:
                os.kill(pid, signal.SIGKILL)
    # A shim whose task directory containerd already removed but which did not exit
    # (seen after a stop while pods were still being deleted): by the address it was
    # started with, this node's socket.
    socket = str(state.parent / "containerd.sock").encode()
    for proc in Path("/proc").iterdir():
        with contextlib.suppress(OSError, ValueError):
            cmdline = (proc / "cmdline").read_bytes().split(b"\0")
            if b"containerd-shim" in cmdline[0] and socket in cmdline:
                os.kill(int(proc.name), signal.SIGKILL)


def clean_host(
    run_dir: Path, bin: Path, cgroup_top: str = hoststate.KUBEPODS, host: bool = True
) -> None:
    """Shims and pod processes, cgroups, mounts, the run dir; with ``host`` (the node
    that owns the host-wide state, nodelayout.py) iptables and the fixed paths too."""
    kill_shims(run_dir / "containerd")
    hoststate.remove_kubepods(cgroup_top)
    hoststate.unmount_under(run_dir)
    if CONTAINER_LOGS.is_dir():
        for link in CONTAINER_LOGS.iterdir():
            if link.is_symlink() and str(os.readlink(link)).startswith(f"{run_dir}/"):
                link.unlink()
    if host:
        _clean_shared(bin)
    shutil.rmtree(run_dir, ignore_errors=True)


def _clean_shared(bin: Path) -> None:
    """What every kubelet on this host shares: iptables, the device-plugin directory
    (a fixed path, whatever the root dir), libcni's cache, the empty fixed dirs."""
    # kube-proxy's own cleanup first (iptables, ipvs, nftables), then whatever is left.
    if (bin / "kube-proxy").exists():
        with contextlib.suppress(subprocess.TimeoutExpired):
            subprocess.run([str(bin / "kube-proxy"), "--cleanup"], capture_output=True, timeout=60)
    hoststate.remove_node_rules()
    hoststate.remove_node_ipsets()  # the policy engine's, free once no rule uses them
    for path in (DEVICE_PLUGINS / "kubelet.sock", DEVICE_PLUGINS / "kubelet_internal_checkpoint"):
        path.unlink(missing_ok=True)
    for cached in CNI_CACHE.glob(f"{cni.NETWORK}-*-eth0"):  # sandboxes of this network
        sandbox_id = cached.name[len(cni.NETWORK) + 1 : -len("-eth0")]
        for leftover in CNI_CACHE.glob(f"*-{sandbox_id}-*"):
            leftover.unlink(missing_ok=True)
    for d in (DEVICE_PLUGINS, DEVICE_PLUGINS.parent, CONTAINER_LOGS, CNI_CACHE, CNI_CACHE.parent):
        with contextlib.suppress(OSError):  # only where empty: anything else is not ours
            d.rmdir()


def fixed_path_leftovers(run_dir: Path) -> list[str]:
    """What of the node is left in the fixed paths above (empty when clean)."""
    found = [str(p) for p in CNI_CACHE.glob(f"{cni.NETWORK}-*")]
    found += [str(p) for p in (DEVICE_PLUGINS / "kubelet.sock",) if p.exists()]
    if CONTAINER_LOGS.is_dir():
        found += [
            str(link)
            for link in CONTAINER_LOGS.iterdir()
            if link.is_symlink() and str(os.readlink(link)).startswith(f"{run_dir}/")
        ]
    return found
