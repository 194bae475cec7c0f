"""A whole local test cluster: test network, real control plane on it, test kubelet.

Order matters: the bridge comes first so the apiserver can bind its address
(``ControlPlane(api_host=network.gateway)``); pods reach it there from their
namespaces, and the host reaches it on the same address (kubectl, the kubeconfig).
Torn down in reverse: kubelet (kills every pod process, deletes the Node), control
plane, network.

``images`` stands in for images' baked-in files: ``{image: {container_path:
host_path}}``, with ``"*"`` for every image; it is read when a container starts, so
a test may fill it after the cluster is up, e.g.
``cluster.images["*"] = {"/models": str(tiny_model)}``.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tests.cluster.controlplane import ControlPlane, OnPlane, build_binaries
from tests.cluster.kubelet import TestKubelet
from tests.cluster.network import TestNetwork


@dataclass
class LocalCluster(OnPlane):
    network: TestNetwork
    plane: ControlPlane | None = None
    kubelet: TestKubelet | None = None
    images: dict[str, dict[str, str]] = field(default_factory=dict)

    @classmethod
    def start(cls, node_name: str = "node-1", **kubelet_args: Any) -> LocalCluster:
        cluster = cls(network=TestNetwork())
        try:
            cluster.network.start()
            cluster.plane = ControlPlane(build_binaries(), api_host=cluster.network.gateway)
            cluster.plane.start()
            kubelet_args.setdefault("path_prefix", [str(Path(sys.executable).parent)])
            cluster.kubelet = TestKubelet(
                cluster.plane.kubeconfig,
                node_name=node_name,
                network=cluster.network,
                api=(cluster.network.gateway, cluster.plane.api_port),
                image_mounts=cluster.image_mounts,
                **kubelet_args,
            ).start()
        except BaseException:
            cluster.stop()
            raise
        return cluster

    def image_mounts(self, image: str) -> dict[str, str]:
        return {**self.images.get("*", {}), **self.images.get(image, {})}

    def stop(self) -> None:
        try:
            if self.kubelet is not None:
                self.kubelet.stop()
        finally:
            try:
                if self.plane is not None:
                    self.plane.stop()
            finally:
                self.network.stop()
