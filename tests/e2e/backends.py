"""Where the Kubernetes e2e suite runs: a real node, the test kubelet, or kind.

- ``node`` (what ``make test`` runs): the real control plane with a real kubelet,
  containerd, runc, CNI and kube-proxy (tests/cluster/realcluster.py), pods from the
  images ``make images`` builds; the router is reached through its Service.
- ``local``: the same control plane with the test kubelet (pods are local processes
  from this checkout's environment); the router is reached at its pod IP.
- ``kind``: a kind cluster (needs Docker and kind) with the same images loaded; the
  router is reached through a port-forward to its Service.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import tempfile
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Protocol

from dpserve.plumbing.ports import free_port
from tests.chart import tools
from tests.cluster.controlplane import build_binaries
from tests.cluster.registry import Registry, deliver
from tests.images.build import BuiltImage

REPO = Path(__file__).resolve().parents[2]


class Backend(Protocol):
    def kubectl(
        self, *args: str, check: bool = True, input: str | None = None
    ) -> subprocess.CompletedProcess[str]: ...

    def helm(self, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]: ...

    def helm_values(self) -> list[str]: ...

    def provide_files(self, mounts: dict[str, Path]) -> None: ...

    def router_url(self, namespace: str, name: str) -> str: ...

    def get(self, namespace: str, *what: str) -> Any: ...

    def pod_ready(self, namespace: str, selector: str) -> bool: ...

    def close(self) -> None: ...


class _Common:
    kubeconfig: Path

    def kubectl(
        self, *args: str, check: bool = True, input: str | None = None
    ) -> subprocess.CompletedProcess[str]:
        cmd = [shutil.which("kubectl") or "kubectl", f"--kubeconfig={self.kubeconfig}", *args]
        return subprocess.run(cmd, check=check, capture_output=True, text=True, input=input)

    def helm(self, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        env = tools.helm_env(Path(tempfile.mkdtemp(prefix="dpserve-helm-")))
        env["KUBECONFIG"] = str(self.kubeconfig)
        result = subprocess.run(
            [str(tools.helm()), *args], capture_output=True, text=True, env=env, timeout=300
        )
        if check and result.returncode != 0:
            raise RuntimeError(f"helm {' '.join(args)} failed: {result.stderr}")
        return result

    def get(self, namespace: str, *what: str) -> Any:
        return json.loads(self.kubectl("-n", namespace, "get", *what, "-o", "json").stdout)

    def pod_ready(self, namespace: str, selector: str) -> bool:
        items = self.get(namespace, "pods", "-l", selector)["items"]
        return bool(items) and all(
            any(c["type"] == "Ready" and c["status"] == "True" for c in conds)
            for conds in ((p.get("status") or {}).get("conditions") or [] for p in items)
        )


class LocalBackend(_Common):
    """The real control plane of tests/cluster with the test kubelet."""

    def __init__(self, cluster: Any) -> None:
        self.cluster = cluster
        self.kubeconfig = cluster.kubeconfig
        self._router: tuple[float, str, str] = (0.0, "", "")

    def helm_values(self) -> list[str]:
        return []  # images are ignored: pods run from this test's environment

    def provide_files(self, mounts: dict[str, Path]) -> None:
        self.cluster.images["*"] = {k: str(v) for k, v in mounts.items()}

    def router_url(self, namespace: str, name: str) -> str:
        """A Ready router pod's address (no kube-proxy here: Service IPs do not route)."""
        cached_at, key, url = self._router
        if key == f"{namespace}/{name}" and time.monotonic() - cached_at < 2:
            return url
        selector = f"app.kubernetes.io/instance={name},app.kubernetes.io/component=router"
        for pod in self.get(namespace, "pods", "-l", selector)["items"]:
            conds = (pod.get("status") or {}).get("conditions") or []
            if any(c["type"] == "Ready" and c["status"] == "True" for c in conds):
                url = f"http://{pod['status']['podIP']}:8000"
                self._router = (time.monotonic(), f"{namespace}/{name}", url)
                return url
        raise LookupError(f"no ready router pod for {namespace}/{name}")

    def close(self) -> None:
        """The session's local_cluster fixture owns the cluster and stops it."""


def image_values(images: Mapping[str, BuiltImage]) -> list[str]:
    """Helm values that point the chart at these images, never pulled."""
    values = []
    for target, built in images.items():
        repository, _, tag = built.ref.rpartition(":")
        values.append(
            f"--set-string=image.{target}.repository={repository},image.{target}.tag={tag}"
        )
    return [*values, "--set-string=image.pullPolicy=Never"]


class NodeBackend(_Common):
    """The real control plane with a real node: containerd, runc, CNI, kube-proxy.

    The images are the ones ``make images`` built, carried into the node's containerd
    through a local registry when its copy differs (tests/cluster/registry.py: only
    new layers move; nothing at all when the config digests match). The router is
    reached as a user reaches it: through the ClusterIP of its Service, which
    kube-proxy routes on this host.
    """

    def __init__(self, cluster: Any, images: Mapping[str, BuiltImage]) -> None:
        self.cluster = cluster
        self.kubeconfig = cluster.kubeconfig
        self.images = dict(images)
        deliver(self.images, cluster.node, Registry(build_binaries() / "registry"))

    def ensure_nodes(self, count: int) -> list[Any]:
        """At least ``count`` real nodes (the session's cluster keeps the ones added),
        each holding the images."""
        nodes = self.cluster.ensure_nodes(count)
        for node in nodes:
            deliver(self.images, node, Registry(build_binaries() / "registry"))
        return list(nodes)

    def shrink_to(self, count: int) -> None:
        """Back to ``count`` real nodes (RealCluster.shrink_to)."""
        self.cluster.shrink_to(count)

    def helm_values(self) -> list[str]:
        return image_values(self.images)

    def provide_files(self, mounts: dict[str, Path]) -> None:
        """The worker image carries /models (the tiny model and LoRA): nothing to add."""

    def router_url(self, namespace: str, name: str) -> str:
        service = self.get(namespace, "service", name)
        ip, port = service["spec"]["clusterIP"], service["spec"]["ports"][0]["port"]
        self.cluster.node.wait_routed(ip)
        return f"http://{ip}:{port}"

    def close(self) -> None:
        """The session's real_cluster fixture owns the cluster and stops it."""


class KindBackend(_Common):
    """A kind cluster with the images ``make images`` builds loaded (Docker and kind)."""

    def __init__(self, images: Mapping[str, BuiltImage]) -> None:
        self.name = "dpserve-e2e"
        self.kubeconfig = Path(tempfile.mkdtemp(prefix="dpserve-kind-")) / "kubeconfig"
        self.images = dict(images)
        self._forwards: dict[str, tuple[subprocess.Popen[bytes], str]] = {}
        create = ["kind", "create", "cluster", "--name", self.name]
        subprocess.run([*create, "--kubeconfig", str(self.kubeconfig)], check=True)
        refs = [built.ref for built in self.images.values()]
        subprocess.run(["kind", "load", "docker-image", *refs, "--name", self.name], check=True)

    def helm_values(self) -> list[str]:
        return image_values(self.images)

    def provide_files(self, mounts: dict[str, Path]) -> None:
        """The worker image carries /models (the tiny model and LoRA): nothing to add."""

    def router_url(self, namespace: str, name: str) -> str:
        key = f"{namespace}/{name}"
        if key not in self._forwards or self._forwards[key][0].poll() is not None:
            port = free_port()
            proc = subprocess.Popen(
                [shutil.which("kubectl") or "kubectl", f"--kubeconfig={self.kubeconfig}",
                 "-n", namespace, "port-forward", f"svc/{name}", f"{port}:80"],
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            )  # fmt: skip
            time.sleep(1)
            self._forwards[key] = (proc, f"http://127.0.0.1:{port}")
        return self._forwards[key][1]

    def close(self) -> None:
        for proc, _ in self._forwards.values():
            proc.terminate()
        subprocess.run(["kind", "delete", "cluster", "--name", self.name], check=False)


def kind_unavailable() -> str | None:
    """Why kind cannot run here, or None."""
    if shutil.which("kind") is None:
        return "kind is not installed"
    if shutil.which("docker") is None:
        return "docker is not installed"
    if subprocess.run(["docker", "info"], capture_output=True).returncode != 0:
        return "no Docker engine is running"
    return None
