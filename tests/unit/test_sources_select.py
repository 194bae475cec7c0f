"""Which files a diffusers pipeline needs, on real repositories' listings
(tests/unit/repo_listings) and on the refusals (dpserve/sources/select.py)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from dpserve.sources.select import NotAPipeline, components, select

LISTINGS = Path(__file__).parent / "repo_listings"


def _listing(name: str) -> dict[str, Any]:
    data: dict[str, Any] = json.loads((LISTINGS / f"{name}.json").read_text())
    return data


def _selected(name: str) -> set[str]:
    data = _listing(name)
    return set(select(data["files"], data["model_index"]).files)


NEVER = (".bin", ".pt", ".pth", ".ckpt", ".onnx", ".onnx_data", ".msgpack", ".h5", ".xml")


@pytest.mark.parametrize("name", sorted(p.stem for p in LISTINGS.glob("*.json")))
def test_every_listing_gives_a_loadable_pipeline_and_nothing_else(name: str) -> None:
    data = _listing(name)
    chosen = select(data["files"], data["model_index"])
    assert set(chosen.files) <= set(data["files"])
    # Only model_index.json at the top: no single-file checkpoints, READMEs, pictures.
    assert [f for f in chosen.files if "/" not in f] == ["model_index.json"]
    assert not [f for f in chosen.files if f.endswith(NEVER)]
    assert not [f for f in chosen.files if ".fp16." in f]  # every one has plain weights
    # Each component's folder, and only those.
    assert {f.split("/")[0] for f in chosen.files if "/" in f} == set(chosen.components)
    for folder in chosen.components:
        assert any(f.startswith(f"{folder}/") and f.endswith(".json") for f in chosen.files)
    # Shards come with their index, and an index with all its shards.
    for f in chosen.files:
        if "-of-" in f:
            folder, base = f.rsplit("/", 1)[0], f.rsplit("/", 1)[1].split("-0")[0]
            assert f"{folder}/{base}.safetensors.index.json" in chosen.files


def test_flux_dev() -> None:
    chosen = _selected("flux1-dev")
    assert "flux1-dev.safetensors" not in chosen and "ae.safetensors" not in chosen
    assert {
        "transformer/diffusion_pytorch_model-00001-of-00003.safetensors",
        "transformer/diffusion_pytorch_model-00003-of-00003.safetensors",
        "transformer/diffusion_pytorch_model.safetensors.index.json",
        "text_encoder_2/model-00002-of-00002.safetensors",
        "tokenizer/merges.txt",
        "tokenizer_2/spiece.model",
        "scheduler/scheduler_config.json",
        "vae/diffusion_pytorch_model.safetensors",
    } <= chosen
    assert len(chosen) == 23  # of 29 files


def test_sd35_takes_the_plain_weights_not_the_fp16_variants_nor_comfyui_files() -> None:
    chosen = _selected("sd3.5-large")
    assert "text_encoder/model.safetensors" in chosen
    assert "text_encoder/model.fp16.safetensors" not in chosen
    assert "text_encoder_3/model.safetensors.index.json" in chosen
    assert "text_encoder_3/model.safetensors.index.fp16.json" not in chosen
    assert not [f for f in chosen if f.startswith("text_encoders/")]
    assert "SD3.5L_example_workflow.json" not in chosen  # a root json is no component's


def test_wan22_has_two_transformers_and_scalar_settings() -> None:
    data = _listing("wan2.2-t2v-a14b")
    assert components(data["model_index"]) == (
        "scheduler",
        "text_encoder",
        "tokenizer",
        "transformer",
        "transformer_2",
        "vae",
    )
    chosen = _selected("wan2.2-t2v-a14b")
    assert len([f for f in chosen if f.startswith("transformer_2/") and "-of-" in f]) == 12
    assert not [f for f in chosen if f.startswith(("assets/", "examples/"))]


def test_qwen_image_keeps_its_chat_template() -> None:
    assert "tokenizer/chat_template.jinja" in _selected("qwen-image")


def test_sdxl_leaves_every_other_format_behind() -> None:
    chosen = _selected("sdxl-base-1.0")
    assert {f for f in chosen if f.startswith("unet/")} == {
        "unet/config.json",
        "unet/diffusion_pytorch_model.safetensors",
    }
    assert not [f for f in chosen if f.startswith(("vae_1_0/", "vae_decoder/", "vae_encoder/"))]


INDEX = {"_class_name": "StableDiffusionPipeline", "unet": ["diffusers", "UNet2DConditionModel"]}


def test_a_component_with_only_pickles_is_refused_by_name() -> None:
    files = ["model_index.json", "unet/config.json", "unet/diffusion_pytorch_model.bin"]
    with pytest.raises(NotAPipeline) as refused:
        select(files, INDEX)
    message = str(refused.value)
    assert "'unet'" in message and "diffusion_pytorch_model.bin" in message
    assert "safetensors" in message and "convert" in message


def test_a_component_with_only_onnx_is_refused_too() -> None:
    with pytest.raises(NotAPipeline, match=r"'unet' has weights only as unet\.onnx"):
        select(["model_index.json", "unet/config.json", "unet/unet.onnx"], INDEX)


def test_only_a_variant_takes_that_variant_and_two_are_refused() -> None:
    one = ["model_index.json", "unet/config.json", "unet/diffusion_pytorch_model.fp16.safetensors"]
    assert "unet/diffusion_pytorch_model.fp16.safetensors" in select(one, INDEX).files
    two = [*one, "unet/diffusion_pytorch_model.bf16.safetensors"]
    with pytest.raises(NotAPipeline, match=r"only as precision variants \(bf16, fp16\)"):
        select(two, INDEX)


def test_no_model_index_is_no_pipeline() -> None:
    with pytest.raises(NotAPipeline, match=r"no model_index\.json at the top"):
        select(["unet/config.json"], INDEX)


def test_a_component_name_that_leaves_the_folder_is_refused() -> None:
    with pytest.raises(NotAPipeline, match="no folder name"):
        select(["model_index.json"], {"_class_name": "X", "../etc": ["diffusers", "Y"]})
