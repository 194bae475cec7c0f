"""A local image registry that carries the built images into the test node's containerd.

``docker save`` piped into ``ctr images import`` moves every byte of every layer each
time: about 4 minutes for the 6 GB worker image, even when only its 1.3 MB dpserve
layer changed. Through a registry, Docker pushes only the layers the registry lacks
and containerd pulls only the layers it lacks, so a code change moves a few MB. This is
the local-registry pattern kind documents, minus the need for a registry image:
distribution's ``registry`` binary is built from its Go module (build.sh).

The registry runs only while images are carried (``serving()``); its storage persists
in the cache (``~/.cache/dpserve/registry``), so layers pushed once stay pushed. Before
it serves, an offline garbage collection removes the layers only untagged manifests
referenced (a tag's previous pushes). It listens on a fixed loopback port
(``DPSERVE_REGISTRY_PORT``, default 5001): Docker remembers, per registry host, the
compressed digest of each layer it pushed, and a stable host is what lets a second
push skip compressing the 5.6 GB torch layer again. Docker treats 127.0.0.0/8 as an
insecure (plain HTTP) registry without configuration; containerd is told per pull.
"""

from __future__ import annotations

import os
import socket
import subprocess
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import httpx

from tests.cluster.daemon import Daemon, kill_recorded
from tests.images.build import DOCKER, BuiltImage

CACHE = Path(os.environ.get("DPSERVE_CACHE", Path.home() / ".cache" / "dpserve")) / "registry"
PORT = int(os.environ.get("DPSERVE_REGISTRY_PORT", "5001"))


def config_yaml(storage: Path, port: int) -> str:
    return f"""version: 0.1
log:
  level: warn
storage:
  filesystem:
    rootdirectory: {storage}
  delete:
    enabled: true
http:
  addr: 127.0.0.1:{port}
"""


@dataclass
class Registry:
    binary: Path
    cache: Path = CACHE
    port: int = PORT

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    @contextmanager
    def serving(self, timeout_s: float = 30) -> Iterator[str]:
        """The registry up at ``address`` for the block; stopped after it."""
        self.cache.mkdir(parents=True, exist_ok=True)
        pidfile = self.cache / "registry.pid"
        kill_recorded(pidfile)  # one a killed run left serving
        _refuse_taken_port(self.port)
        config = self.cache / "config.yml"
        config.write_text(config_yaml(self.cache / "storage", self.port))
        if (self.cache / "storage" / "docker" / "registry" / "v2" / "repositories").is_dir():
            collected = subprocess.run(
                [str(self.binary), "garbage-collect", "--delete-untagged", str(config)],
                capture_output=True,
                text=True,
            )
            if collected.returncode != 0:  # an empty store fails to "mark"; nothing to do
                raise RuntimeError(f"registry garbage-collect: {collected.stdout[-500:]}")
        daemon = Daemon(
            "registry", [str(self.binary), "serve", str(config)], self.cache / "registry.log",
            pidfile,
        ).start()  # fmt: skip
        try:
            self._wait(daemon, timeout_s)
            yield self.address
        finally:
            daemon.stop()

    def _wait(self, daemon: Daemon, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if daemon.exited() is not None:
                raise RuntimeError(f"the registry exited: {daemon.log_tail()}")
            try:
                if httpx.get(f"http://{self.address}/v2/", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        raise TimeoutError(f"the registry did not answer in {timeout_s}s: {daemon.log_tail()}")


def _refuse_taken_port(port: int) -> None:
    with socket.socket() as s:
        # As the registry binds (Go sets SO_REUSEADDR): connections of the last run
        # lingering in TIME_WAIT do not make the port taken.
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError as exc:
            raise RuntimeError(
                f"port {port} for the test image registry is taken ({exc}); "
                "set DPSERVE_REGISTRY_PORT to a free one"
            ) from exc


def push(built: BuiltImage, address: str) -> str:
    """Push one built image to the registry at ``address``; the pushed name."""
    name = f"{address}/{built.ref}"
    subprocess.run([DOCKER, "tag", built.ref, name], check=True, capture_output=True)
    done = subprocess.run([DOCKER, "push", name], capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"docker push {name}: {done.stderr.strip() or done.stdout[-500:]}")
    return name


class Puller(Protocol):
    """What a node offers to receive images (RealNode)."""

    def image_id(self, ref: str) -> str | None: ...

    def pull_image(self, source: str, name: str) -> None: ...


def deliver(images: Mapping[str, BuiltImage], node: Puller, registry: Registry) -> None:
    """Make the node hold exactly these images under their own names.

    Skipped for an image whose config digest the node already has under that name,
    so a warm run does not even start the registry."""
    stale = [b for b in images.values() if node.image_id(b.ref) != b.image_id]
    if not stale:
        return
    with registry.serving() as address:
        for built in stale:
            node.pull_image(push(built, address), built.ref)
            if node.image_id(built.ref) != built.image_id:
                raise RuntimeError(f"{built.ref}: the node holds another image than the one built")
