"""The real node's own images, made on this machine: the pod sandbox and a test image.

* ``pause``: one static binary (``pause.c``, compiled with ``gcc -static``) that
  containerd runs as every pod sandbox's PID 1 (its ``sandbox_image``).
* ``busybox``: Debian's static busybox with a link per applet, ``/etc/passwd``
  and a world-writable ``/tmp``: enough for tests of what the runtime enforces
  (user, read-only root, capabilities, signals, networking with ``wget``/``nc``).

Each writes an OCI archive (``oci.py``) and returns its config digest.
"""

from __future__ import annotations

import os
import subprocess
import tempfile
from pathlib import Path
from typing import IO

from tests.cluster.oci import ImageConfig, write_oci_archive

HERE = Path(__file__).resolve().parent
PAUSE_REF = "dpserve-pause:1"
BUSYBOX_REF = "dpserve-busybox:1"
BUSYBOX = Path("/bin/busybox")


def pause_image(out: IO[bytes]) -> str:
    with tempfile.TemporaryDirectory(prefix="dpserve-pause-") as tmp:
        rootfs = Path(tmp) / "rootfs"
        rootfs.mkdir()
        subprocess.run(
            ["gcc", "-static", "-O2", "-s", "-o", str(rootfs / "pause"), str(HERE / "pause.c")],
            check=True,
            capture_output=True,
        )
        return write_oci_archive(out, rootfs, PAUSE_REF, ImageConfig(entrypoint=("/pause",)))


def busybox_image(out: IO[bytes]) -> str:
    with tempfile.TemporaryDirectory(prefix="dpserve-busybox-") as tmp:
        rootfs = Path(tmp) / "rootfs"
        bin_dir = rootfs / "bin"
        bin_dir.mkdir(parents=True)
        (bin_dir / "busybox").write_bytes(BUSYBOX.read_bytes())
        (bin_dir / "busybox").chmod(0o755)
        applets = subprocess.run(
            [str(BUSYBOX), "--list"], check=True, capture_output=True, text=True
        ).stdout.split()
        for applet in applets:
            if applet != "busybox":
                (bin_dir / applet).symlink_to("busybox")
        for d in ("etc", "root", "proc", "sys", "dev"):
            (rootfs / d).mkdir()
        (rootfs / "tmp").mkdir(mode=0o1777)
        os.chmod(rootfs / "tmp", 0o1777)  # mkdir's mode is masked by the umask
        (rootfs / "etc/passwd").write_text(
            "root:x:0:0:root:/root:/bin/sh\nnobody:x:65534:65534:nobody:/:/bin/false\n"
        )
        (rootfs / "etc/group").write_text("root:x:0:\nnogroup:x:65534:\n")
        config = ImageConfig(cmd=("sh",), env=("PATH=/bin",))
        return write_oci_archive(out, rootfs, BUSYBOX_REF, config)
