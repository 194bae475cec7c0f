"""The test node's own containerd: its config, its process, images and leftovers.

A private instance (own config, socket and state under the node's run directory),
so it neither needs nor disturbs a containerd that Docker or anything else runs on
this machine. Its root (content store, snapshots, metadata) lives in the cache
(``~/.cache/dpserve/node/containerd``) so that imported images, some of them
gigabytes, survive from run to run. runc keeps its container state under the run
directory too, not in the system's ``/run/containerd/runc``.

Images live in CRI's namespace ``k8s.io``, under containerd's normalized names
(``docker.io/library/NAME:TAG`` for ``NAME:TAG``), which is what the kubelet asks for.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from tests.cluster.daemon import Daemon
from tests.cluster.oci import host_arch, normalize_ref

NAMESPACE = "k8s.io"
KIND_LABEL = "io.cri-containerd.kind"  # "sandbox" or "container", set by the CRI plugin


def config_toml(
    root: Path, state: Path, socket: Path, runc_root: Path, cni_conf_dir: Path, sandbox_image: str
) -> str:
    """containerd 1.6's config (version 2) for the test node."""
    cri = 'plugins."io.containerd.grpc.v1.cri"'
    return f"""version = 2
root = "{root}"
state = "{state}"
# Snapshotters this machine cannot use only slow the start down with errors.
disabled_plugins = [
  "io.containerd.snapshotter.v1.aufs",
  "io.containerd.snapshotter.v1.btrfs",
  "io.containerd.snapshotter.v1.devmapper",
  "io.containerd.snapshotter.v1.zfs",
  "io.containerd.tracing.processor.v1.otlp",
]

[grpc]
  address = "{socket}"

[plugins."io.containerd.internal.v1.opt"]
  path = "{root / "opt"}"

[{cri}]
  # Built here and imported (images.py): nothing is pulled from a registry.
  sandbox_image = "{sandbox_image}"
  # Pod network namespaces under the state dir, not in the shared /run/netns.
  netns_mounts_under_state_dir = true
  enable_selinux = false
  # This machine grants root no CAP_SYS_RESOURCE: runc cannot lower a container's
  # oom_score_adj below its own (the kubelet asks -998 for sandboxes) and would
  # fail every pod. Restricted, CRI clamps the request to containerd's own score.
  restrict_oom_score_adj = true
  stream_server_address = "127.0.0.1"
  stream_server_port = "0"

[{cri}.containerd]
  snapshotter = "overlayfs"
  default_runtime_name = "runc"

[{cri}.containerd.runtimes.runc]
  runtime_type = "io.containerd.runc.v2"

[{cri}.containerd.runtimes.runc.options]
  BinaryName = "runc"
  Root = "{runc_root}"
  # The kubelet uses the cgroupfs driver (cgroup v1 here, no systemd to delegate to).
  SystemdCgroup = false

[{cri}.cni]
  bin_dir = "/usr/lib/cni"
  conf_dir = "{cni_conf_dir}"
  max_conf_num = 1
"""


@dataclass
class Containerd:
    run_dir: Path  # socket, state, logs: wiped when the node stops
    root: Path  # content and snapshots: kept
    sandbox_image: str
    daemon: Daemon | None = field(default=None, repr=False)

    @property
    def socket(self) -> Path:
        return self.run_dir / "containerd.sock"

    @property
    def state(self) -> Path:
        return self.run_dir / "containerd"

    @property
    def cni_conf_dir(self) -> Path:
        return self.run_dir / "cni" / "net.d"

    @property
    def pidfile(self) -> Path:
        return self.run_dir / "containerd.pid"

    def start(self, timeout_s: float = 30) -> Containerd:
        self.root.mkdir(parents=True, exist_ok=True)
        config = self.run_dir / "containerd.toml"
        config.write_text(
            config_toml(
                self.root,
                self.state,
                self.socket,
                self.run_dir / "runc",
                self.cni_conf_dir,
                normalize_ref(self.sandbox_image),
            )
        )
        self.daemon = Daemon(
            "containerd",
            ["containerd", "--config", str(config)],
            self.run_dir / "containerd.log",
            self.pidfile,
        ).start()
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.daemon.exited() is not None:
                raise RuntimeError(f"containerd exited: {self.daemon.log_tail()}")
            if self.socket.exists() and self.ctr("version", check=False).returncode == 0:
                return self
            time.sleep(0.1)
        raise TimeoutError(f"containerd not serving in {timeout_s}s: {self.daemon.log_tail()}")

    def stop(self) -> None:
        if self.daemon is not None:
            self.daemon.stop()

    def ctr(self, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        proc = subprocess.run(
            ["ctr", "--address", str(self.socket), "--namespace", NAMESPACE, *args],
            capture_output=True,
            text=True,
        )
        if check and proc.returncode != 0:
            raise RuntimeError(
                f"ctr {' '.join(args)}: {proc.stderr.strip() or proc.stdout.strip()}"
            )
        return proc

    # ------------------------------------------------------------------ images

    def import_image(self, archive: IO[bytes] | Path) -> None:
        """Load a docker-save or OCI archive (a file or a stream) and unpack it for CRI.

        A stream with a file descriptor (a file, a pipe from ``docker save``) is read
        by ctr straight from that descriptor, from its current offset."""
        if isinstance(archive, Path):
            with archive.open("rb") as f:
                self._import(f)
        else:
            self._import(archive)

    def _import(self, stream: IO[bytes]) -> None:
        cmd = ["ctr", "--address", str(self.socket), "--namespace", NAMESPACE]
        with tempfile.TemporaryFile() as err:
            # ctr reads the archive from stdin ("-"); its progress lines go nowhere.
            with subprocess.Popen(
                [*cmd, "images", "import", "-"],
                stdin=stream if _has_fileno(stream) else subprocess.PIPE,
                stdout=subprocess.DEVNULL,
                stderr=err,
            ) as proc:
                if proc.stdin is not None:  # a stream without a descriptor: copy it over
                    with proc.stdin:
                        shutil.copyfileobj(stream, proc.stdin, 1 << 20)
            if proc.returncode != 0:
                err.seek(0)
                raise RuntimeError(f"ctr images import: {err.read().decode(errors='replace')}")

    def pull_image(self, source: str, name: str) -> None:
        """Pull ``source`` from a plain-HTTP registry and keep it as ``name`` (NAME:TAG).

        Only the blobs the content store lacks are fetched, and only new layers are
        unpacked: after a code change, the worker image's few small top layers."""
        self.ctr("images", "pull", "--plain-http", source)
        self.ctr("images", "tag", "--force", source, normalize_ref(name))
        self.ctr("images", "rm", source)

    def image_id(self, ref: str) -> str | None:
        """The config digest of the image named ``ref`` (what CRI calls the image ID)."""
        listing = self.ctr("images", "ls", f"name=={normalize_ref(ref)}").stdout.splitlines()
        if len(listing) < 2:
            return None
        target = listing[1].split()[2]  # REF TYPE DIGEST SIZE PLATFORMS LABELS
        blob = self._blob(target)
        if "manifests" in blob:  # an index: this machine's manifest
            entries = [m for m in blob["manifests"] if _ours(m.get("platform"))]
            if not entries:
                return None
            blob = self._blob(entries[0]["digest"])
        config: str = blob["config"]["digest"]
        return config

    def remove_image(self, ref: str) -> None:
        """Untag ``ref``; when no other name is left for its image, also the ID the CRI
        plugin names it by, so that containerd can collect its content."""
        image_id = self.image_id(ref)
        self.ctr("images", "rm", "--sync", normalize_ref(ref), check=False)
        if image_id is None:
            return
        target = {
            line.split()[2]
            for line in self.ctr("images", "ls", f"name=={image_id}").stdout.splitlines()[1:]
        }
        others = [
            line.split()[0]
            for line in self.ctr("images", "ls").stdout.splitlines()[1:]
            if line.split()[2] in target and line.split()[0] != image_id
        ]
        if not others:
            self.ctr("images", "rm", "--sync", image_id, check=False)

    def _blob(self, digest: str) -> dict[str, Any]:
        loaded: dict[str, Any] = json.loads(self.ctr("content", "get", digest).stdout)
        return loaded

    # ------------------------------------------------------------------ containers

    def remove_all_containers(self, on_sandbox: Callable[[str, str | None], None]) -> None:
        """Kill and delete every container of namespace ``k8s.io``, containers before
        their sandboxes; ``on_sandbox(id, netns_path)`` runs before a sandbox's task is
        deleted (its network is torn down while its namespace still exists)."""
        ids = self.ctr("containers", "ls", "--quiet").stdout.split()
        infos = [json.loads(self.ctr("containers", "info", cid).stdout) for cid in ids]
        infos.sort(key=lambda info: info.get("Labels", {}).get(KIND_LABEL) == "sandbox")
        for info in infos:
            cid = info["ID"]
            if info.get("Labels", {}).get(KIND_LABEL) == "sandbox":
                on_sandbox(cid, _netns_path(info))
            # --force kills a running task (SIGKILL) before deleting it.
            self.ctr("tasks", "delete", "--force", cid, check=False)
            self.ctr("containers", "delete", cid, check=False)
        # The CRI plugin's own directories of these go at its next start (it removes
        # those of containers that no longer exist).


def _has_fileno(stream: IO[bytes]) -> bool:
    try:
        stream.fileno()
    except (AttributeError, OSError, ValueError):  # io.BytesIO raises UnsupportedOperation
        return False
    return True


def _ours(platform: dict[str, str] | None) -> bool:
    return platform is None or (
        platform.get("os") == "linux" and platform.get("architecture") == host_arch()
    )


def _netns_path(info: dict[str, Any]) -> str | None:
    spec = info.get("Spec") or {}
    for ns in spec.get("linux", {}).get("namespaces", []):
        if ns.get("type") == "network":
            path: str | None = ns.get("path")
            return path
    return None
