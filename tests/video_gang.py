"""Runs video generations on a real gang of rank processes, each with the worker's own
executor (``boot.build_executor``: process groups, encoder relay, CFG split, stop
gate) after the worker's warm-up, without the gang loop or the ingress; the output
rank's replies and progress come back as wire frames, and from every rank how many
transformer passes it computed."""

from __future__ import annotations

import dataclasses
import io
import os
import tempfile
from collections.abc import Sequence
from pathlib import Path

import av
import msgspec
import numpy as np
import torch

from dpserve.contract import protocol as p
from dpserve.contract.layout import ParallelConfig
from tests.parallel_harness import start_ranks


@dataclasses.dataclass(frozen=True)
class VideoRun:
    """One generation: its params, its uploads (an input image) and the denoiser call
    its driver halts at (0: none)."""

    params: p.GenerateParams
    halt_at: int = 0
    blobs: tuple[bytes, ...] = ()


@dataclasses.dataclass(frozen=True)
class Answer:
    """The output rank's reply and its progress replies, decoded; each rank's passes."""

    reply: p.Message
    partials: list[p.Message]
    passes: list[int]
    tokens: list[int]  # each rank's tokens in its transformer blocks' last pass


def _rank(
    rank: int, model: str, layout: dict[str, int], runs: Sequence[VideoRun], store: str, out: str
) -> None:
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    torch.set_num_threads(1)
    import torch.distributed as dist

    from dpserve.config.worker import WorkerConfig
    from dpserve.worker.boot import build_executor as _build_executor
    from dpserve.worker.boot import warmup as _warmup
    from dpserve.worker.comm import init_gang

    config = WorkerConfig(model=Path(model), port=1, device="cpu", **layout)
    device = torch.device("cpu")
    comm = init_gang(config.parallel, rank, store, device, 120.0)
    executor = _build_executor(config, comm, device, torch.float32)
    _warmup(executor, config)
    # A pass embeds the latents once: counted where the transformer really runs (a CFG
    # split's rank returns the other's branch without computing it).
    passes = [0]
    embed = executor.pipe.transformer.patch_embedding
    embed.register_forward_hook(lambda *_: passes.__setitem__(0, passes[0] + 1))
    seen = [0]  # and how many tokens its blocks hold (all of them, or its slice)
    first = executor.pipe.transformer.blocks[0]
    first.register_forward_hook(lambda _, __, out: seen.__setitem__(0, out.shape[1]))
    answers: list[tuple[list[bytes], list[list[bytes]]]] = []
    counts: list[tuple[int, int]] = []
    for index, run in enumerate(runs):
        partials: list[list[bytes]] = []
        asked = {"n": 0}

        def halt(run: VideoRun = run, asked: dict[str, int] = asked) -> p.RequestError | None:
            asked["n"] += 1
            stop = run.halt_at and asked["n"] >= run.halt_at
            return p.RequestError(p.CANCELLED, "the job was cancelled") if stop else None

        driver = comm.info.is_driver
        reply = executor.generate(
            f"job{index}",
            run.params,
            0.0,
            halt if driver else None,
            run.blobs,
            partials.append if driver else None,
        )
        answers.append((reply, partials))
        counts.append((passes[0] - sum(c for c, _ in counts), seen[0]))
    Path(f"{out}.{rank}").write_bytes(msgspec.msgpack.encode(counts))
    if comm.info.is_output_rank:
        Path(out).write_bytes(msgspec.msgpack.encode(answers))
    dist.destroy_process_group()


def run_videos(model: Path, runs: Sequence[VideoRun], **layout: int) -> list[Answer]:
    """``runs`` in order on a gang laid out as ``layout`` (``WorkerConfig``'s cfg, sp,
    ulysses, ring; one process per rank)."""
    size = ParallelConfig(**layout).gang_size
    with tempfile.TemporaryDirectory(prefix="dpserve-video-gang-") as tmp:
        out = os.path.join(tmp, "answers.msgpack")
        args = (str(model), layout, list(runs), os.path.join(tmp, "store"), out)
        start_ranks(_rank, args, size)
        raw = msgspec.msgpack.decode(Path(out).read_bytes())
        counts = [msgspec.msgpack.decode(Path(f"{out}.{r}").read_bytes()) for r in range(size)]
    return [
        Answer(
            p.decode(reply),
            [p.decode(frames) for frames in partials],
            [c[i][0] for c in counts],
            [c[i][1] for c in counts],
        )
        for i, (reply, partials) in enumerate(raw)
    ]


def decoded_frames(mp4: bytes) -> np.ndarray:
    """An mp4's frames, (frames, height, width, 3) uint8."""
    with av.open(io.BytesIO(mp4)) as container:
        return np.stack([f.to_ndarray(format="rgb24") for f in container.decode(video=0)])
