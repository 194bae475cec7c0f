"""The three images, built here (``make images``) and run as a cluster would run them:
as user 10001, read-only root, a tmpfs at /tmp, no capabilities, no network."""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path

import pytest
import yaml

from tests.images.build import DOCKER, TARGETS, BuiltImage, build_images

# A cold build (Docker's install, the Debian base, torch) takes minutes; the fixture's
# time counts against the first test that asks for it.
pytestmark = [pytest.mark.images, pytest.mark.cluster, pytest.mark.timeout(3600)]

ROOT = Path(__file__).resolve().parents[2]
APP_VERSION = yaml.safe_load((ROOT / "charts" / "dpserve" / "Chart.yaml").read_text())["appVersion"]
# What the chart and the operator's pods ask of the runtime (readOnlyRootFilesystem,
# an emptyDir at /tmp, capabilities dropped, no privilege escalation).
LOCKED_DOWN = (
    "--network=none",
    "--read-only",
    "--tmpfs=/tmp",
    "--cap-drop=ALL",
    "--security-opt=no-new-privileges",
)
VENV_PYTHON = "/opt/venv/bin/python"

# Loads the baked model and LoRA the way a worker does (dpserve's loader, safetensors
# only, offline) and makes one small image with the adapter active.
WORKER_PROBE = """
import json, os
from pathlib import Path
import torch, diffusers
from dpserve.worker.pipeline import load_pipeline
pipe = load_pipeline(Path("/models/tiny"), torch.device("cpu"), torch.float32)
pipe.load_lora_weights("/models/loras/tiny", adapter_name="tiny", use_safetensors=True)
image = pipe(prompt="a red square", height=64, width=64, num_inference_steps=2,
             generator=torch.Generator().manual_seed(0)).images[0]
print(json.dumps({"uid": os.getuid(), "gid": os.getgid(), "torch": torch.__version__,
                  "diffusers": diffusers.__version__, "size": list(image.size),
                  "adapters": pipe.get_list_adapters()}))
"""


@pytest.fixture(scope="session")
def images(built_images: dict[str, BuiltImage]) -> dict[str, BuiltImage]:
    return built_images


def run(image: str, *args: str, entrypoint: str | None = None) -> subprocess.CompletedProcess[str]:
    """One container from ``image``, locked down, as the image's own user."""
    command = [DOCKER, "run", "--rm", *LOCKED_DOWN]
    if entrypoint is not None:
        command.append(f"--entrypoint={entrypoint}")
    return subprocess.run(
        [*command, image, *args], capture_output=True, text=True, timeout=300, check=False
    )


def inspect(ref: str) -> dict[str, object]:
    out = subprocess.run(
        [DOCKER, "image", "inspect", ref], capture_output=True, text=True, check=True
    )
    config: dict[str, object] = json.loads(out.stdout)[0]["Config"]
    return config


def test_the_three_images_build(images: dict[str, BuiltImage]) -> None:
    assert set(images) == set(TARGETS)
    for target, built in images.items():
        assert built.ref == f"dpserve-{target}:{APP_VERSION}"
        assert built.image_id.startswith("sha256:") and len(built.image_id) == 71
        assert built.size_bytes > 0
        config = inspect(built.ref)
        # Numeric, so the kubelet can check runAsNonRoot without the image's passwd.
        assert config["User"] == "10001:10001"
        assert config["Entrypoint"] == ["dpserve"]
        env = config["Env"]
        assert isinstance(env, list) and "HOME=/home/dpserve" in env
    print({t: f"{b.size_bytes / 1e6:.0f} MB" for t, b in images.items()})


@pytest.mark.parametrize("target", TARGETS)
def test_dpserve_runs_as_10001_on_a_read_only_root(
    images: dict[str, BuiltImage], target: str
) -> None:
    done = run(images[target].ref, "--help")
    assert done.returncode == 0, done.stderr
    assert "make-tiny-model" in done.stdout
    whoami = run(
        images[target].ref,
        "-c",
        "import os; print(os.getuid(), os.getgid())",
        entrypoint=VENV_PYTHON,
    )
    assert whoami.stdout.split() == ["10001", "10001"], whoami.stderr


@pytest.mark.parametrize("target", ["operator", "router"])
def test_light_images_carry_no_torch(images: dict[str, BuiltImage], target: str) -> None:
    ref = images[target].ref
    imported = run(ref, "-c", "import torch", entrypoint=VENV_PYTHON)
    assert imported.returncode != 0 and "No module named 'torch'" in imported.stderr
    listed = run(
        ref,
        "-m",
        "pip",
        "list",
        "--format=json",
        "--disable-pip-version-check",
        entrypoint=VENV_PYTHON,
    )
    assert listed.returncode == 0, listed.stderr
    names = {p["name"].lower() for p in json.loads(listed.stdout)}
    assert "dpserve" in names
    assert not names & {"torch", "diffusers", "transformers", "accelerate", "peft"}, names


def test_worker_loads_the_baked_model_and_lora(images: dict[str, BuiltImage]) -> None:
    done = run(images["worker"].ref, "-c", WORKER_PROBE, entrypoint=VENV_PYTHON)
    assert done.returncode == 0, done.stderr[-4000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert (report["uid"], report["gid"]) == (10001, 10001)
    assert report["size"] == [64, 64]
    assert "tiny" in json.dumps(report["adapters"])


def test_a_rebuild_with_nothing_changed_is_cached(images: dict[str, BuiltImage]) -> None:
    started = time.monotonic()
    again = build_images()
    elapsed = time.monotonic() - started
    assert again == images  # the same image ids: nothing was rebuilt
    assert elapsed < 30, f"a cached rebuild took {elapsed:.1f} s"
