from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from tests.cluster.controlplane import ControlPlane
    from tests.cluster.localcluster import LocalCluster
    from tests.cluster.realcluster import RealCluster
    from tests.e2e.backends import Backend
    from tests.hub.server import Hub
    from tests.images.build import BuiltImage
    from tests.storage.s3 import S3Server


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
def tiny_video_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A Wan-style text-to-video pipeline with random weights (docs/video.md)."""
    from dpserve.worker.tiny_model import build_tiny_pipeline

    return build_tiny_pipeline(tmp_path_factory.mktemp("models") / "tiny-video", "video", seed=0)


@pytest.fixture(scope="session")
def tiny_i2v_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A Wan-style image-to-video pipeline (an input image is required) with random weights."""
    from dpserve.worker.tiny_model import build_tiny_pipeline

    return build_tiny_pipeline(tmp_path_factory.mktemp("models") / "tiny-i2v", "video-i2v", seed=0)


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
def s3_server() -> Iterator[S3Server]:
    """One real S3 server (versitygw over a temporary folder) per run: ``endpoint_url``,
    ``access_key``, ``secret_key``, ``region``, ``client()`` (boto3), ``env()`` (the
    ``AWS_*`` variables), ``new_bucket()``. Built once by tests/storage/build.sh; a
    failed build is an error that says how to fix it, never a skip."""
    from tests.storage.s3 import build_server, running_s3

    with running_s3(build_server()) as server:
        yield server


@pytest.fixture
def aws_env(s3_server: S3Server, monkeypatch: pytest.MonkeyPatch) -> dict[str, str]:
    """This process's (and its children's) AWS_* variables point at the test server."""
    for name in [n for n in os.environ if n.startswith("AWS_")]:
        monkeypatch.delenv(name)
    for name, value in s3_server.env().items():
        monkeypatch.setenv(name, value)
    return s3_server.env()


@pytest.fixture(scope="session")
def hub_server(
    tiny_model: Path, tiny_model_b: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Hub]:
    """A real hub-API server (olah, tests/hub/server.py) serving ``dpserve/tiny``: the tiny
    model at tag ``v1`` and branch ``release``, other weights of the same architecture at
    ``main``. One per run, so read-only: a test that changes a repository starts its own
    with ``tests.hub.server.serve_hub``."""
    from tests.hub.server import TINY_REPO, RepoSpec, serve_hub

    spec = RepoSpec(TINY_REPO, (tiny_model, tiny_model_b))
    with serve_hub(tmp_path_factory.mktemp("hub"), [spec]) as hub:
        yield hub


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


@pytest.fixture(scope="session")
def real_cluster() -> Iterator[RealCluster]:
    """A real control plane and a real node: kubelet, containerd + runc + CNI, kube-proxy.

    Pods run from images the node holds (``tests/cluster/registry.py`` delivers the
    built ones), with 10.245.0.x addresses; Services have cluster IPs (kube-proxy).
    Needs root; skipped where ``real_node_unavailable()`` says why not. Teardown
    checks nothing is left.
    """
    from tests.cluster.realcluster import RealCluster, leftovers, real_node_unavailable

    reason = real_node_unavailable()
    if reason:
        pytest.skip(reason)
    cluster = RealCluster.start()
    try:
        yield cluster
    finally:
        cluster.stop()
    left = leftovers()
    assert not left, f"the real cluster left behind: {left}"


# `make test` runs the suite as two pytest processes side by side, one lane each
# (tests/lanes.sh). The journeys lane holds what needs a machine-wide resource (the test
# network and its clusters, the Docker images: one user at a time) and the `dpserve
# serve` journeys, in collection order; the other lane runs the fast tier, the worker
# gangs and the apiserver-only tests (a control plane on free ports: each lane may start
# its own). The split is by measured time: each lane takes about half the suite, and a
# `dpserve serve` journey marked `rest_lane` runs in the other lane to keep it so.
JOURNEY_MARKERS = ("e2e", "images")
JOURNEY_FIXTURES = frozenset({"local_cluster", "real_cluster", "built_images", "backend"})


@pytest.hookimpl(tryfirst=True)  # before `-m` deselects by the lane marker
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Mark the journeys lane's tests ``journeys``."""
    for item in items:
        fixtures = set(getattr(item, "fixturenames", ()))
        if JOURNEY_FIXTURES & fixtures or (
            any(item.get_closest_marker(m) for m in JOURNEY_MARKERS)
            and not item.get_closest_marker("rest_lane")
        ):
            item.add_marker(pytest.mark.journeys)


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--cluster",
        choices=("node", "local", "kind"),
        default="node",
        help="Kubernetes e2e backend: a real node with the built images (default), the "
        "test kubelet (local, faster: pods are local processes), or kind (needs Docker)",
    )


@pytest.fixture(scope="session")
def built_images() -> dict[str, BuiltImage]:
    """The operator, router and worker images, built by ``make images``'s script: minutes
    on a fresh machine, about a second when nothing changed. Skipped where they cannot be
    built (``images_unavailable()`` says why)."""
    from tests.images.build import build_images, images_unavailable

    reason = images_unavailable()
    if reason is not None:
        pytest.skip(reason)
    return build_images()


@pytest.fixture(scope="session")
def backend(request: pytest.FixtureRequest) -> Iterator[Backend]:
    """The cluster the Kubernetes e2e journey runs on."""
    from tests.e2e.backends import KindBackend, LocalBackend, NodeBackend, kind_unavailable

    choice = request.config.getoption("--cluster")
    if choice == "local":
        yield LocalBackend(request.getfixturevalue("local_cluster"))  # that fixture tears down
        return
    if choice == "node":
        images = request.getfixturevalue("built_images")
        yield NodeBackend(request.getfixturevalue("real_cluster"), images)
        return
    why = kind_unavailable()
    if why is not None:
        pytest.skip(f"--cluster kind needs Docker and kind: {why}")
    kind = KindBackend(request.getfixturevalue("built_images"))
    try:
        yield kind
    finally:
        kind.close()


@pytest.fixture(scope="session")
def tiny_wan_moe_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A Wan 2.2-style pipeline with two denoisers (transformer_2, boundary_ratio)."""
    from dpserve.worker.tiny_model import build_tiny_pipeline

    return build_tiny_pipeline(tmp_path_factory.mktemp("models") / "wan-moe", "wan-moe", seed=0)


@pytest.fixture(scope="session")
def flux2_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A FLUX.2 [klein] pipeline (Flux2Transformer2DModel, 4 heads) with random weights."""
    from dpserve.worker.tiny_model import build_tiny_pipeline

    return build_tiny_pipeline(tmp_path_factory.mktemp("models") / "flux2", "flux2", seed=0)


@pytest.fixture(scope="session")
def flux2_model_b(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny FLUX.2 with other weights: what a weight update loads."""
    from dpserve.worker.tiny_model import build_tiny_pipeline

    return build_tiny_pipeline(tmp_path_factory.mktemp("models") / "flux2-b", "flux2", seed=1)


@pytest.fixture(scope="session")
def flux2_lora(flux2_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A LoRA over every block layer of the tiny FLUX.2, its fused layers included."""
    from dpserve.worker.tiny_flux2 import build_lora

    return build_lora(tmp_path_factory.mktemp("loras") / "flux2-lora", flux2_model, seed=0)


@pytest.fixture(scope="session")
def tiny_sd3_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny SD3.5-style model (dual attention, RMS qk-norm; 4 heads)."""
    from dpserve.worker.tiny_model import build_tiny_pipeline

    return build_tiny_pipeline(tmp_path_factory.mktemp("models") / "tiny-sd3", "sd3", seed=0)


@pytest.fixture(scope="session")
def tiny_qwen_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A Qwen-Image pipeline (QwenImagePipeline, Qwen2.5-VL encoder) with random weights."""
    from dpserve.worker.tiny_model import build_tiny_pipeline

    return build_tiny_pipeline(tmp_path_factory.mktemp("models") / "qwen", "qwen-image", seed=0)


@pytest.fixture(scope="session")
def tiny_qwen_edit_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Qwen-Image-Edit's pipeline (QwenImageEditPipeline: the VL encoder reads the
    reference image) over the tiny Qwen-Image shapes. Its processor needs torchvision."""
    pytest.importorskip("torchvision", reason="Qwen2VLProcessor's video processor needs it")
    from dpserve.worker.tiny_model import build_tiny_pipeline

    folder = tmp_path_factory.mktemp("models") / "qwen-edit"
    return build_tiny_pipeline(folder, "qwen-image-edit", seed=0)


@pytest.fixture(scope="session")
def tiny_qwen_edit_plus_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Qwen-Image-Edit-Plus's pipeline (several reference images) over the same shapes."""
    pytest.importorskip("torchvision", reason="Qwen2VLProcessor's video processor needs it")
    from dpserve.worker.tiny_model import build_tiny_pipeline

    folder = tmp_path_factory.mktemp("models") / "qwen-edit-plus"
    return build_tiny_pipeline(folder, "qwen-image-edit-plus", seed=0)


@pytest.fixture(scope="session")
def tiny_qwen_model_b(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The Qwen-Image architecture with other weights: what a weight update loads."""
    from dpserve.worker.tiny_model import build_tiny_pipeline

    return build_tiny_pipeline(tmp_path_factory.mktemp("models") / "qwen-b", "qwen-image", seed=1)


@pytest.fixture(scope="session")
def tiny_qwen_lora(tiny_qwen_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    from dpserve.worker.tiny_model import build_tiny_lora

    return build_tiny_lora(tmp_path_factory.mktemp("loras") / "qwen", tiny_qwen_model, seed=0)


@pytest.fixture(scope="session")
def tiny_sd3_model_b(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny SD3 architecture with other weights: what a weight update loads."""
    from dpserve.worker.tiny_model import build_tiny_pipeline

    return build_tiny_pipeline(tmp_path_factory.mktemp("models") / "tiny-sd3-b", "sd3", seed=1)


@pytest.fixture(scope="session")
def tiny_sd3_lora(tiny_sd3_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    from dpserve.worker.tiny_model import build_tiny_lora

    return build_tiny_lora(tmp_path_factory.mktemp("loras") / "sd3", tiny_sd3_model, seed=0)
