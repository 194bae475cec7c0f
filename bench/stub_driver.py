"""A driver that answers instantly: the router's own cost, without a model behind it.

It speaks the real wire protocol on a real ROUTER socket (ping, model_info, control
states it holds without loading anything, generate with one fixed PNG), so every
byte the router handles is real; only the diffusion is missing. A double for
benchmarks and router tests, never part of the product.
"""

from __future__ import annotations

import argparse
import asyncio
import io
import random
import uuid
from pathlib import Path

import msgspec
import zmq
import zmq.asyncio
from PIL import Image

from dpserve.contract import model_info as mi
from dpserve.contract import protocol as p
from dpserve.contract import validation as pv
from dpserve.contract.control_state import StateDoc
from dpserve.contract.layout import ParallelConfig, describe
from dpserve.plumbing.curve import Gatekeeper, WireKey
from dpserve.plumbing.transport import bind_router


def _png(side: int = 64) -> bytes:
    """The answer's PNG: one colour at 64² (the default), else ``side``² of seeded
    noise, about as many bytes as a photo-like image of that size (for benches that
    move the bytes: bench/outputs.py)."""
    buf = io.BytesIO()
    if side == 64:
        Image.new("RGB", (64, 64), (200, 120, 40)).save(buf, format="PNG")
    else:
        noise = random.Random(side).randbytes(side * side * 3)
        Image.frombytes("RGB", (side, side), noise).save(buf, format="PNG")
    return buf.getvalue()


def _model_info(replica: int) -> mi.ModelInfo:
    """A one-rank image model at /stub whose features leave every check to the stub."""
    features = mi.Features(
        edits=True,
        inpainting=True,
        max_edit_images=pv.MAX_EDIT_IMAGES,
        partial_images=pv.MAX_PARTIAL_IMAGES,
        output_formats=list(pv.OUTPUT_FORMATS),
        output_compression=True,
        max_n=pv.Limits.max_n,
        step_caches={},
        step_cache_default=None,
        max_sequence_length=None,
        flow_shift=None,
        vae_tiling=False,
        vae_slicing=False,
        video=None,
    )
    return mi.ModelInfo(
        replica=replica,
        layout=describe(ParallelConfig()),
        parallel=mi.GangShape(tp=1, sp=1, ulysses=1, ring=1, cfg=1),
        gang_size=1,
        threads_per_rank=1,
        device="cpu",
        dtype="float32",
        size_factor=16,
        max_side=pv.Limits.max_side,
        max_steps=pv.Limits.max_steps,
        max_sequence_length=None,
        max_sessions=0,
        session_idle_timeout_s=0.0,
        compile=None,
        realtime="unsupported: a stub",
        features=features,
        cfg_parallel="off",
        without_true_cfg="whole",
        model_path="/stub",
        pipeline_class="StubDriver",
        components=[],
        released=False,
        loras=[],
        rank_weights=[mi.RankWeights(rank=0, tp_rank=0, sp_rank=0, cfg_rank=0, bytes={})],
        ranks=1,
    )


async def serve(port: int, replica: int, key: WireKey | None = None, side: int = 64) -> None:
    ctx = zmq.asyncio.Context()
    # Held for the process's life, as a driver's socket thread holds its own.
    _gate = Gatekeeper(ctx, key) if key is not None else None
    sock = bind_router(ctx, f"tcp://127.0.0.1:{port}", key=key)
    png, boot, served = _png(side), uuid.uuid4().hex, 0
    held: dict[str, object] = StateDoc().to_builtins()
    info = msgspec.to_builtins(_model_info(replica))
    while True:
        identity, *frames = await sock.recv_multipart()
        message = p.decode(frames)
        if message.kind == p.PING:
            body: object = p.PingResult(
                replica=replica, boot_id=boot, status="ok", busy=False, queue_depth=0,
                served=served, released=False, progress_age_s=0.0, control=held,
            )  # fmt: skip
            reply = p.encode(p.RESULT, message.id, body)
        elif message.kind == p.CONTROL:
            # A control state sent by a router is simply held (there is nothing to load).
            control = message.body_as(p.ControlRequest)
            if control.state is not None:
                held = control.state
            result = {**info, "state": held}
            reply = p.encode(
                p.RESULT, message.id, p.ControlResult(op=control.op, replica=replica, result=result)
            )
        else:
            served += 1
            meta = p.ImageMeta(index=0, blob=0, seed=1, format="png", width=side, height=side)
            result = p.GenerateResult(
                images=[meta], replica=replica, inference_time_s=0.0, queue_time_s=0.0,
                peak_memory_mb=0.0,
            )  # fmt: skip
            reply = p.encode(p.RESULT, message.id, result, [png])
        await sock.send_multipart([identity, *reply])


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--replica", type=int, default=0)
    parser.add_argument("--wire-key-file", type=Path, default=None, help="serve under CURVE")
    parser.add_argument("--side", type=int, default=64, help="the answer's width and height")
    args = parser.parse_args()
    key = None if args.wire_key_file is None else WireKey.load(args.wire_key_file)
    asyncio.run(serve(args.port, args.replica, key, args.side))
