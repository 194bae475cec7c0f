from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from tests.cluster.controlplane import ControlPlane


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from dpserve.worker.tiny_model import build_tiny_pipeline

    return build_tiny_pipeline(tmp_path_factory.mktemp("models") / "tiny", seed=0)


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
def control_plane() -> Iterator[ControlPlane]:
    """One real control plane (etcd, apiserver, controller-manager, scheduler) per run."""
    from tests.cluster.controlplane import ControlPlane, build_binaries

    plane = ControlPlane(build_binaries()).start()
    try:
        yield plane
    finally:
        plane.stop()
