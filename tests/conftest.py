from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from tests.cluster.controlplane import ControlPlane
    from tests.cluster.localcluster import LocalCluster
    from tests.e2e.backends import Backend


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from dpserve.worker.tiny_model import build_tiny_pipeline

    return build_tiny_pipeline(tmp_path_factory.mktemp("models") / "tiny", seed=0)


@pytest.fixture(scope="session")
def tiny4_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model with 4 attention heads (tp x ulysses layouts split them 4 ways)."""
    from dpserve.worker.tiny_model import build_tiny_pipeline

    return build_tiny_pipeline(tmp_path_factory.mktemp("models") / "tiny4", "tiny4", seed=0)


@pytest.fixture(scope="session")
def tiny_model_b(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The same architecture with other weights: what a weight update loads."""
    from dpserve.worker.tiny_model import build_tiny_pipeline

    return build_tiny_pipeline(tmp_path_factory.mktemp("models") / "tiny-b", seed=1)


@pytest.fixture(scope="session")
def tiny_lora(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    from dpserve.worker.tiny_model import build_tiny_lora

    return build_tiny_lora(tmp_path_factory.mktemp("loras") / "lora", tiny_model, seed=0)


@pytest.fixture(scope="session")
def allow_tmp(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, str]:
    """Worker flags that let control ops load from this run's temporary folders, where
    the fixtures build models and LoRAs (a worker allows only its model folder)."""
    return ("--allow-path", str(tmp_path_factory.getbasetemp()))


@pytest.fixture(scope="session")
def control_plane() -> Iterator[ControlPlane]:
    """One real control plane (etcd, apiserver, controller-manager, scheduler) per run."""
    from tests.cluster.controlplane import ControlPlane, build_binaries

    plane = ControlPlane(build_binaries()).start()
    try:
        yield plane
    finally:
        plane.stop()


@pytest.fixture(scope="session")
def local_cluster() -> Iterator[LocalCluster]:
    """Test network, a real control plane on the bridge address, and a test kubelet.

    Pods bound to node ``node-1`` run as local processes with their own 10.244.0.x
    addresses (tests/cluster/kubelet.py). Needs root; skipped without it.
    """
    from tests.cluster.localcluster import LocalCluster
    from tests.cluster.network import available

    reason = available()
    if reason:
        pytest.skip(reason)
    cluster = LocalCluster.start()
    try:
        yield cluster
    finally:
        cluster.stop()


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--cluster",
        choices=("local", "kind"),
        default="local",
        help="Kubernetes e2e backend: the local control plane (default) or kind (needs Docker)",
    )


@pytest.fixture(scope="session")
def backend(request: pytest.FixtureRequest) -> Iterator[Backend]:
    """The cluster the Kubernetes e2e journey runs on."""
    from tests.e2e.backends import KindBackend, LocalBackend, kind_unavailable

    if request.config.getoption("--cluster") == "local":
        yield LocalBackend(request.getfixturevalue("local_cluster"))  # that fixture tears down
        return
    why = kind_unavailable()
    if why is not None:
        pytest.skip(f"--cluster kind needs Docker and kind: {why}")
    kind = KindBackend()
    try:
        yield kind
    finally:
        kind.close()
