"""Runs one denoising request on a real gang of processes and keeps the final latents.

The ranks use the worker's own pieces (process groups, ``ModelParallel``, the
denoiser patch) without the ingress, so the latents themselves can be compared
across layouts: images would hide differences below one grey level.
``DPSERVE_TEST_DEVICE=cuda`` runs the ranks on CUDA tensors (bench/gpu.sh).
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
from pathlib import Path
from typing import Any

import torch
import torch.multiprocessing as mp

from dpserve.contract.layout import ParallelConfig
from dpserve.contract.protocol import (
    EditInput,
    GenerateParams,
)

TEXT_TOKENS = 32
# The request the gang-math tests run in every layout: CFG on, so cfg gangs split it.
REQUEST = dict(
    prompt="a red fox in the snow",
    negative_prompt="blurry",
    true_cfg_scale=4.0,
    width=64,
    height=64,
    num_inference_steps=3,
    seed=[7],
)
# What every rank imports before its first line runs. A forkserver imports them once
# per test session; each gang's ranks fork from it instead of importing them again
# (about 10 s of CPU per rank on this machine). Nothing there starts a thread or
# touches a device, so a forked rank sets its own threads and device as a spawned one.
PRELOAD = (
    "torch",
    "transformers",
    "diffusers",
    "dpserve.worker.executor",
    "tests.parallel_harness",
)


def start_ranks(fn: Any, args: tuple[Any, ...], nprocs: int) -> None:
    """``fn(rank, *args)`` in ``nprocs`` fresh processes, until all of them return.

    On CUDA they are spawned: there the preloads leave the driver initialized in the
    forkserver (seen on the H200: "Cannot re-initialize CUDA in forked subprocess"),
    and the imports' seconds matter little on a GPU machine's cores."""
    if os.environ.get("DPSERVE_TEST_DEVICE", "cpu").startswith("cuda"):
        mp.start_processes(fn, args=args, nprocs=nprocs, start_method="spawn")
        return
    mp.set_forkserver_preload(list(PRELOAD))
    mp.start_processes(fn, args=args, nprocs=nprocs, start_method="forkserver")


def _rank(
    rank: int,
    model: str,
    layout: dict[str, int],
    request: dict[str, Any],
    store: str,
    out: str,
    read: bool,
    blobs: list[bytes],
) -> None:
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    torch.set_num_threads(1)
    import torch.distributed as dist

    from dpserve.worker.comm import init_gang
    from dpserve.worker.denoiser import DenoiserPatch
    from dpserve.worker.edit import edit_call
    from dpserve.worker.executor import denoisers_of
    from dpserve.worker.parallel import ModelParallel
    from dpserve.worker.pipeline import (
        call_defaults,
        cfg_requested,
        guides_by_scale,
        load_pipeline,
        pipeline_kwargs,
        size_factor,
    )
    from dpserve.worker.video_call import video_kwargs

    config = ParallelConfig(**layout)
    device = torch.device(os.environ.get("DPSERVE_TEST_DEVICE", "cpu"))
    # On one GPU the ranks share it, which NCCL refuses: gloo moves their CUDA tensors.
    shared = device.type == "cuda" and torch.cuda.device_count() < config.gang_size
    comm = init_gang(config, rank, store, device, 120.0, "gloo" if shared else None)
    parallel = ModelParallel(comm.info, comm.model_groups, config)
    reader = parallel.read_transformer if read else (lambda folder, cls, dtype: None)
    pipe = load_pipeline(Path(model), device, torch.float32, parallel.prepare, None, reader)
    report = parallel.read_report
    shares = {"share": None if report is None else report.share}
    if report is not None:
        shares |= {"largest": report.largest(), "split": report.largest(report.split)}
    Path(out).with_name(f"read-{rank}.json").write_text(json.dumps(shares))
    parallel.check_loaded(pipe, TEXT_TOKENS)
    edit = EditInput(images=list(range(len(blobs)))) if blobs else None
    params = GenerateParams(**request, edit=edit)
    defaults = call_defaults(pipe)
    make_kwargs = pipeline_kwargs if params.video is None else video_kwargs
    kwargs = {**make_kwargs(params, defaults, "latent"), "max_sequence_length": TEXT_TOKENS}
    if edit is not None:  # the worker's edit path: its pipeline, images and size
        pipe, extra = edit_call(pipe, params, blobs, size_factor(pipe))
        kwargs.update(extra)
    patch = DenoiserPatch(comm.info.cfg_rank, comm.cfg_group, lambda: None, parallel.wrap)
    by_guidance = guides_by_scale(pipe)  # a video model's CFG is its guidance_scale
    split = patch.can_split(pipe.transformer) and cfg_requested(params, defaults, by_guidance)
    with torch.inference_mode(), contextlib.ExitStack() as patched:
        for denoiser in denoisers_of(pipe):  # Wan 2.2's second expert too
            patched.enter_context(patch.applied(denoiser, split))
        output = pipe(**kwargs)
    latents = output.images if params.video is None else output.frames
    if rank == 0:
        torch.save(latents.cpu(), out)
    dist.destroy_process_group()


def final_latents(
    model: Path,
    layout: dict[str, int],
    request: dict[str, Any],
    read: bool = True,
    images: tuple[bytes, ...] = (),
) -> torch.Tensor:
    """The final latents of ``request`` on a gang with ``layout`` (one process per rank).

    ``read``: tp ranks read only their pieces of the checkpoint, as a worker does;
    False loads the transformer whole on every rank and cuts it after. ``images``:
    the request is an edit of these encoded files.
    """
    return gang_run(model, layout, request, read, images)[0]


def gang_run(
    model: Path,
    layout: dict[str, int],
    request: dict[str, Any],
    read: bool = True,
    images: tuple[bytes, ...] = (),
) -> tuple[torch.Tensor, list[dict[str, float | None]]]:
    """:func:`final_latents`, and what each rank read of its transformer's checkpoint:
    ``share`` of all its elements, the ``largest`` share of any one tensor and of any
    ``split`` (tp-cut) one; ``share`` None where the whole was loaded."""
    size = ParallelConfig(**layout).gang_size
    with tempfile.TemporaryDirectory(prefix="dpserve-math-") as tmp:
        out = os.path.join(tmp, "latents.pt")
        store = os.path.join(tmp, "store")
        args = (str(model), layout, request, store, out, read, list(images))
        start_ranks(_rank, args, size)
        reads = [json.loads(Path(tmp, f"read-{r}.json").read_text()) for r in range(size)]
        return torch.load(out), reads


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got - want).abs().max() / want.abs().max())
