"""Built images reach the real node through the local registry (tests/cluster/registry.py)."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import pytest

from tests.cluster.controlplane import build_binaries
from tests.cluster.registry import Registry, deliver

if TYPE_CHECKING:
    from tests.cluster.realcluster import RealCluster
    from tests.images.build import BuiltImage

# The images may have to be built first (minutes on a fresh machine).
pytestmark = [pytest.mark.cluster, pytest.mark.images, pytest.mark.timeout(2400)]


def test_a_missing_image_is_delivered_and_a_present_one_is_not_moved(
    real_cluster: RealCluster, built_images: dict[str, BuiltImage]
) -> None:
    node, registry = real_cluster.node, Registry(build_binaries() / "registry")
    deliver(built_images, node, registry)  # whatever this run starts from
    router = built_images["router"]
    node.remove_image(router.ref)
    assert node.image_id(router.ref) is None
    deliver(built_images, node, registry)
    assert node.image_id(router.ref) == router.image_id
    started = time.monotonic()
    deliver(built_images, node, registry)  # every digest matches: not even a registry start
    assert time.monotonic() - started < 5
