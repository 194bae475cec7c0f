"""Qwen-Image (``QwenImageTransformer2DModel``) split across real gangs computes the
single-rank result: final latents of the tiny Qwen-Image model (float32, same seed, true
CFG, one thread per rank) within 1e-5 of the latents' magnitude in every 2-rank layout and
a 4-rank one, cfg2 byte-identical. The prompt's text tokens do not divide by the split
(the cut pads them with masked keys), and a batch of two prompts of different lengths
exercises the masks that differ between rows."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.parallel_harness import final_latents, relative_error

pytestmark = pytest.mark.gang

# 17 and 7 text tokens: the split pads them (3 and 1 keys masked at sp=4).
REQUEST = dict(
    prompt="a red fox in snow",
    negative_prompt="ugly blurry",
    true_cfg_scale=4.0,
    width=64,
    height=64,
    num_inference_steps=3,
    seed=[7],
)
LAYOUTS = {
    "ulysses2": dict(sp=2, ulysses=2),
    "ring2": dict(sp=2, ring=2),
    "tp2": dict(tp=2),
    "ulysses2xring2": dict(sp=4, ulysses=2, ring=2),
    "tp2xulysses2": dict(tp=2, sp=2, ulysses=2),
}


@pytest.fixture(scope="module")
def reference(tiny_qwen_model: Path) -> torch.Tensor:
    return final_latents(tiny_qwen_model, {}, REQUEST)


def test_cfg2_is_byte_identical_to_one_rank(tiny_qwen_model: Path, reference: torch.Tensor) -> None:
    latents = final_latents(tiny_qwen_model, {"cfg": 2}, REQUEST)
    assert torch.equal(latents, reference)


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_layout_matches_one_rank(name: str, tiny_qwen_model: Path, reference: torch.Tensor) -> None:
    latents = final_latents(tiny_qwen_model, LAYOUTS[name], REQUEST)
    assert latents.shape == reference.shape
    error = relative_error(latents, reference)
    print(f"{name}: relative error {error:.2e}")
    assert error <= 1e-5, f"{name}: relative error {error:.2e}"


def test_a_request_without_cfg_splits_over_the_cfg_ranks(tiny_qwen_model: Path) -> None:
    plain = {k: v for k, v in REQUEST.items() if k not in ("negative_prompt", "true_cfg_scale")}
    latents = final_latents(tiny_qwen_model, {"cfg": 2}, plain)
    error = relative_error(latents, final_latents(tiny_qwen_model, {}, plain))
    print(f"cfg2 lent: relative error {error:.2e}")
    assert 0 < error <= 1e-5, f"relative error {error:.2e}"  # split (not bitwise), and close


def _rows_rank(rank: int, model: str, layout: dict[str, int], store: str, out: str) -> None:
    """One transformer call on a batch of two prompts of different lengths (masked
    differently per row), split by ``layout``; rank 0 also runs it whole."""
    import os

    import torch.distributed as dist
    from diffusers.models.transformers.transformer_qwenimage import (
        QwenImageTransformer2DModel,
    )

    from dpserve.contract.layout import ParallelConfig
    from dpserve.worker.comm import init_gang
    from dpserve.worker.parallel import ModelParallel

    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    torch.set_num_threads(1)
    config = ParallelConfig(**layout)
    comm = init_gang(config, rank, store, torch.device("cpu"), 120.0)
    parallel = ModelParallel(comm.info, comm.model_groups, config)
    transformer = QwenImageTransformer2DModel.from_pretrained(Path(model, "transformer")).eval()
    gen = torch.Generator().manual_seed(5)
    c = transformer.config
    text = torch.randn(2, 13, c.joint_attention_dim, generator=gen)
    mask = torch.ones(2, 13, dtype=torch.long)
    mask[1, 9:] = 0  # the second prompt is 9 tokens long
    call = dict(
        hidden_states=torch.randn(2, 16, c.in_channels, generator=gen),
        encoder_hidden_states=text,
        encoder_hidden_states_mask=mask,
        timestep=torch.tensor([0.7, 0.7]),
        img_shapes=[[(1, 4, 4)]] * 2,
        return_dict=False,
    )
    with torch.inference_mode():
        whole = transformer(**call)[0]
        parallel.prepare(transformer)
        split = parallel.wrap(transformer.forward, lend=False)(**call)[0]
    if rank == 0:
        Path(out).write_text(str(relative_error(split, whole)))
    dist.destroy_process_group()


@pytest.mark.parametrize("layout", [dict(sp=2, ulysses=2), dict(sp=4, ulysses=2, ring=2)])
def test_a_batch_of_prompts_of_different_lengths_splits(
    layout: dict[str, int], tiny_qwen_model: Path, tmp_path: Path
) -> None:
    from dpserve.contract.layout import ParallelConfig
    from tests.parallel_harness import start_ranks

    out = tmp_path / "error"
    args = (str(tiny_qwen_model), layout, str(tmp_path / "store"), str(out))
    start_ranks(_rows_rank, args, ParallelConfig(**layout).gang_size)
    error = float(out.read_text())
    print(f"{layout}: relative error {error:.2e}")
    assert error <= 1e-5
