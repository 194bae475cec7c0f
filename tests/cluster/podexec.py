"""Container launcher for the test kubelet: mounts, hostname, user, then exec.

Run as ``ip netns exec NS unshare --mount --uts --propagation private python
podexec.py SPEC.json``: it is already inside the pod's network namespace and its
own mount and UTS namespaces, so what it mounts is seen by the container alone.
SPEC is JSON written by ``tests/cluster/kubelet.py``::

    {"mounts": [{"type": "bind"|"tmpfs", "source": str, "target": str,
                 "readOnly": bool, "file": bool, "options": str}],
     "hostname": str, "cwd": str, "argv": [str, ...], "env": {str: str},
     "uid": int|null, "gid": int|null, "groups": [int, ...],
     "read_only_root": bool, "parent": int (the kubelet's pid)}

Mount targets outside other mounts must exist (the kubelet makes them);
ones inside an earlier mount are made here. ``read_only_root`` remounts ``/``
read-only after the volumes are mounted (readOnlyRootFilesystem); they keep their
own modes. On success the process becomes
the container's command (same pid); on a set-up error it exits 128 with the reason
on stderr, as a container runtime's start error would.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import json
import os
import signal
import socket
import sys
from pathlib import Path

PR_SET_PDEATHSIG = 1
MS_RDONLY = 1
MS_NOSUID = 2
MS_NODEV = 4
MS_REMOUNT = 32
MS_BIND = 4096
MS_REC = 16384
_REPO = Path(__file__).resolve().parents[2]  # this checkout: pods run its code

_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
_libc.mount.argtypes = [
    ctypes.c_char_p,
    ctypes.c_char_p,
    ctypes.c_char_p,
    ctypes.c_ulong,
    ctypes.c_char_p,
]


def _mount(
    source: str | None, target: str, fstype: str | None, flags: int, data: str | None
) -> None:
    rc = _libc.mount(
        source.encode() if source is not None else None,
        target.encode(),
        fstype.encode() if fstype is not None else None,
        flags,
        data.encode() if data else None,
    )
    if rc != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))


def apply_mounts(mounts: list[dict]) -> None:
    # Sources are opened first and mounted through /proc/self/fd: a volume mounted at
    # /tmp would otherwise hide every later source under the kubelet's /tmp dir.
    sources = {
        i: os.open(m["source"], os.O_PATH | os.O_CLOEXEC)
        for i, m in enumerate(mounts)
        if m["type"] != "tmpfs"
    }
    for i, m in enumerate(mounts):
        target = m["target"]
        if not os.path.lexists(target):  # inside an earlier mount (a volume): make it there
            if m.get("file"):
                os.makedirs(os.path.dirname(target), exist_ok=True)
                open(target, "a").close()
            else:
                os.makedirs(target, exist_ok=True)
        try:
            if m["type"] == "tmpfs":
                _mount("tmpfs", target, "tmpfs", MS_NOSUID | MS_NODEV, m.get("options") or None)
            else:
                _mount(f"/proc/self/fd/{sources[i]}", target, None, MS_BIND | MS_REC, None)
            if m.get("readOnly"):
                _mount(None, target, None, MS_REMOUNT | MS_BIND | MS_RDONLY, None)
        except OSError as e:
            raise OSError(
                e.errno, f"mount {m.get('source', 'tmpfs')} -> {target}: {e.strerror}"
            ) from None


def _traversable(path: str, uid: int, gids: set[int]) -> bool:
    st = os.stat(path)
    if st.st_uid == uid:
        return bool(st.st_mode & 0o100)
    if st.st_gid in gids:
        return bool(st.st_mode & 0o010)
    return bool(st.st_mode & 0o001)


def expose_host_tools(uid: int, gids: set[int]) -> None:
    """Let a non-root container reach this machine's interpreter and repo.

    Pods run the kubelet's own Python (a venv whose interpreter may live under a
    root-only ``/root``). An ancestor the user cannot traverse is masked by a tmpfs
    (in this mount namespace only) holding just the way down to the tool, which is
    bind-mounted back: the user reaches the tools, and nothing else that was there.
    """
    tools = sorted({os.path.realpath(sys.base_prefix), sys.prefix, str(_REPO)})
    masks: dict[str, list[str]] = {}
    for tool in tools:
        parts = Path(tool).parts
        for i in range(2, len(parts) + 1):
            ancestor = str(Path(*parts[:i]))
            if not _traversable(ancestor, uid, gids):
                masks.setdefault(ancestor, []).append(tool)
                break
    for mask, below in masks.items():
        fds = {tool: os.open(tool, os.O_PATH | os.O_CLOEXEC) for tool in below}
        _mount("tmpfs", mask, "tmpfs", MS_NOSUID | MS_NODEV, "mode=755")
        for tool, fd in fds.items():
            os.makedirs(tool, exist_ok=True)
            _mount(f"/proc/self/fd/{fd}", tool, None, MS_BIND | MS_REC, None)


def keep_host_tools_visible(mounts: list[dict]) -> list[dict]:
    """Re-bind the venv and the repo over any volume that hides them.

    Pods run their commands from this machine's venv (images are ignored); a volume
    at, say, /tmp would hide a checkout living under /tmp, and the command with it.
    """
    tools = {sys.prefix, str(_REPO)}
    hidden = [
        t for t in sorted(tools)
        if any(t == m["target"] or t.startswith(m["target"].rstrip("/") + "/") for m in mounts)
    ]  # fmt: skip
    return [*mounts, *({"type": "bind", "source": t, "target": t} for t in hidden)]


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print("usage: podexec.py SPEC.json", file=sys.stderr)
        return 2
    with open(argv[1]) as f:
        spec = json.load(f)
    # Dies with the kubelet thread that started it, even if the test process is
    # killed outright (no orphans); what it forks is swept with the pod's namespace.
    _libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if spec.get("parent") and os.getppid() != spec["parent"]:
        return 128  # the kubelet is already gone
    try:
        apply_mounts(keep_host_tools_visible(spec.get("mounts", [])))
        uid, gid, groups = spec.get("uid"), spec.get("gid"), spec.get("groups") or []
        if uid:
            expose_host_tools(uid, {gid if gid is not None else 0, *groups})
        if spec.get("read_only_root"):
            # Last: only the root mount turns read-only; the volumes keep their modes
            # (a bind made after this would copy the read-only flag).
            _mount(None, "/", None, MS_REMOUNT | MS_BIND | MS_RDONLY, None)
        if spec.get("hostname"):
            socket.sethostname(spec["hostname"])
        if gid is not None or groups:
            os.setgroups(groups)
        if gid is not None:
            os.setgid(gid)
        if uid is not None:
            os.setuid(uid)
        os.chdir(spec.get("cwd") or "/")
    except OSError as e:
        print(f"podexec: container set-up failed: {e}", file=sys.stderr)
        return 128
    command = spec["argv"]
    try:
        os.execvpe(command[0], command, spec["env"])
    except OSError as e:
        print(f"podexec: exec {command[0]!r}: {e.strerror}", file=sys.stderr)
        return 127 if isinstance(e, FileNotFoundError) else 126
    return 0  # not reached


if __name__ == "__main__":
    sys.exit(main(sys.argv))
