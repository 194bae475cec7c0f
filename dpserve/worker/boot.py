"""A rank's boot: the libraries, the model with its parallel split, step caches and
compiler, the warm-up, and (on the driver rank) the driver. ``rank.py`` calls these in order,
then runs the gang loop."""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import msgspec

from dpserve.config.worker import WorkerConfig
from dpserve.contract import protocol as p
from dpserve.contract.layout import describe
from dpserve.worker.commands import GangStatus, Generation
from dpserve.worker.startup import StartupLog

if TYPE_CHECKING:
    from dpserve.worker.compile import Compiler
    from dpserve.worker.driver import Driver
    from dpserve.worker.executor import Executor
    from dpserve.worker.parallel.encoders import EncoderRelay
    from dpserve.worker.step_cache import StepCaches

log = logging.getLogger("dpserve.worker")


def import_libraries(model: Path | None) -> str:
    """The imports every rank pays once before it can load anything, done up front so
    the log times them apart from the load; the pipeline class the model folder names
    too (diffusers imports its module, and transformers' encoders, on first use)."""
    import importlib
    import json

    from dpserve.worker.quiet import quiet_torchvision_fallback

    quiet_torchvision_fallback()
    import diffusers
    import torch
    import transformers

    import dpserve.worker.executor  # noqa: F401  (diffusers' pipeline machinery)

    # Every pipeline module: the edit siblings' lookup (worker/edit.py) imports them.
    importlib.import_module("diffusers.pipelines.auto_pipeline")

    try:
        if model is None:  # a CPU gang's fork server (``preload``): the model is the ranks'
            raise KeyError("no model")
        name = json.loads((model / "model_index.json").read_text())["_class_name"]
        getattr(diffusers, name)
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        pass  # a custom or broken pipeline: the load says what is wrong
    return (
        f"torch {torch.__version__}, diffusers {diffusers.__version__}, "
        f"transformers {transformers.__version__}"
    )


def with_replica(info: Any, replica: int) -> Any:
    import dataclasses

    return dataclasses.replace(info, replica=replica)


def build_executor(cfg: WorkerConfig, comm: Any, device: Any, dtype: Any) -> Executor:
    from dpserve.contract.model_info import GangShape, ReplicaFacts
    from dpserve.worker.control import ControlOps
    from dpserve.worker.executor import Executor
    from dpserve.worker.parallel import ModelParallel, ParallelUnsupported
    from dpserve.worker.pipeline import call_defaults, load_pipeline, size_factor
    from dpserve.worker.sessions import SessionLimits

    parallel = ModelParallel(comm.info, comm.model_groups, cfg.parallel)
    relay = encoder_relay(cfg, comm)
    started = time.perf_counter()
    skip = relay.skipped() if relay is not None else None
    read = parallel.read_transformer
    pipe = load_pipeline(cfg.model, device, dtype, parallel.prepare, skip, read)
    if relay is not None:
        relay.install(pipe, dtype, device)
    log.info("loaded %s in %.2fs", type(pipe).__name__, time.perf_counter() - started)
    defaults = call_defaults(pipe)
    fixed = {}
    if cfg.max_sequence_length is not None:
        if "max_sequence_length" not in defaults:
            raise ValueError(f"{type(pipe).__name__} does not take --max-sequence-length")
        fixed["max_sequence_length"] = cfg.max_sequence_length
    text_tokens = fixed.get("max_sequence_length", defaults.get("max_sequence_length"))
    parallel.check_loaded(pipe, text_tokens)
    ops = ControlOps(pipe, cfg.model, device, None, parallel, relay, cfg.allow_paths)
    limits = SessionLimits(
        cfg.max_sessions, int(cfg.max_session_mb * (1 << 20)), cfg.session_idle_timeout_s
    )
    caches, compiler = accel(cfg, pipe)
    executor = Executor(
        pipe,
        comm,
        ops,
        GangStatus(),
        device,
        defaults,
        fixed,
        limits,
        parallel,
        caches,
        compiler,
        cfg.max_frames,
        cfg.lora_cache_mb,
    )
    if cfg.cfg > 1 and not executor.split_ok:
        # Its second rank would only redo the first one's work.
        raise ParallelUnsupported(
            f"--cfg {cfg.cfg} needs a denoiser that marks its two guidance branches "
            f"(cache_context, as diffusers' true-CFG pipelines do); "
            f"{type(pipe).__name__}'s does not: use --cfg 1 and more replicas"
        )
    # Requests without true CFG: split over the CFG ranks' sequence too, or run twice.
    # (Never a compiled or step-cached call: DenoiserStack.forward_for.)
    lent = parallel.lending if compiler is None else None
    layout = cfg.parallel
    ops.info = ReplicaFacts(
        replica=cfg.replica,
        layout=describe(layout),
        parallel=GangShape(
            tp=layout.tp,
            sp=layout.sp,
            ulysses=layout.ulysses,
            ring=layout.ring,
            cfg=layout.cfg,
        ),
        gang_size=cfg.gang_size,
        threads_per_rank=cfg.threads_per_rank,
        device=device.type,
        dtype=str(dtype).removeprefix("torch."),
        size_factor=size_factor(pipe),
        max_side=cfg.max_side,
        max_steps=cfg.max_steps,
        max_sequence_length=text_tokens,
        max_sessions=cfg.max_sessions,
        session_idle_timeout_s=cfg.session_idle_timeout_s,
        compile=compiler.info() if compiler is not None else None,
        realtime=executor.sessions.unsupported() or "supported",
        features=executor.features.info(),
        cfg_parallel="off" if cfg.cfg == 1 else "split",
        without_true_cfg=f"lent to sequence parallel ({lent})" if lent else "whole",
    )
    return executor


def accel(cfg: WorkerConfig, pipe: Any) -> tuple[StepCaches, Compiler | None]:
    """The step caches this replica offers and its compiler; a set-up that cannot
    have what its flags ask is refused at start (docs/worker.md)."""
    from dpserve.worker import compile, step_cache
    from dpserve.worker.executor import denoiser_of
    from dpserve.worker.features import video_support
    from dpserve.worker.parallel import ParallelUnsupported
    from dpserve.worker.pipeline import size_factor
    from dpserve.worker.preview import output_size

    try:
        default = step_cache.service_default(
            cfg.step_cache, cfg.step_cache_threshold, cfg.step_cache_interval
        )
        refused = step_cache.refusal(cfg.tp, cfg.sp, cfg.compile)
        caches = step_cache.offer(denoiser_of(pipe), refused)
        if default is not None and default.type not in caches.offered:
            raise ValueError(f"--step-cache {default.type}: {caches.refusal}")
        caches = dataclasses.replace(caches, default=default)
        if not cfg.compile:
            return caches, None
        if video_support(pipe, cfg.max_frames) is not None:
            raise ValueError("--compile is not verified on video models: leave it off")
        problem = compile.refusal(cfg.tp, cfg.sp, cfg.step_cache)
        if problem is not None:
            raise ValueError(problem)
        sizes = compile.compile_sizes(
            cfg.compile_sizes, output_size(pipe, {}), size_factor(pipe), cfg.max_side
        )
    except ValueError as exc:
        raise ParallelUnsupported(str(exc)) from None
    return caches, compile.Compiler(sizes)


def encoder_relay(cfg: WorkerConfig, comm: Any) -> EncoderRelay | None:
    """Gangs of more than one rank keep the text encoders on the output rank only."""
    import json

    from dpserve.worker.parallel.encoders import EncoderRelay, encoder_names

    if cfg.gang_size == 1:
        return None
    index = json.loads((cfg.model / "model_index.json").read_text())
    return EncoderRelay(encoder_names(index), comm.info.is_output_rank, comm.broadcast_bytes)


def warmup(executor: Executor, cfg: WorkerConfig, startup: StartupLog | None = None) -> None:
    """Generations through the real path (CFG split included) before serving: one small
    one (a video model's: 5 frames), or with --compile one at each compile size, which
    compiles its graph there (worker/compile.py); then the compiler is sealed."""
    from dpserve.worker.compile import graphs
    from dpserve.worker.pipeline import call_defaults, size_factor
    from dpserve.worker.video_call import warmup_reference

    # The smallest square from 64 px whose image tokens the sp ranks can split evenly.
    factor = size_factor(executor.pipe)
    side = max(factor, 64)
    while ((side // factor) ** 2) % cfg.sp:
        side += factor
    compiler = executor.compiler
    sizes = compiler.sizes if compiler is not None else ((side, side),)
    compiled_before = graphs()
    video = executor.features.video
    takes = call_defaults(executor.pipe)
    clip = (
        None
        if video is None
        else p.VideoSpec(num_frames=min(5, video.max_frames), fps=video.default_fps)
    )
    for width, height in sizes:
        # An image-to-video model's warm-up animates a grey image, an edit-only
        # model's (Qwen-Image-Edit) edits one.
        needs_image = executor.features.edit.needs_image or (
            video is not None and not video.text_to_video
        )
        blobs = [warmup_reference(width, height)] if needs_image else []
        params = p.GenerateParams(
            prompt="warmup",
            # A pipeline's CFG is true CFG (a negative prompt and true_cfg_scale) where
            # it takes them, else its guidance_scale, on by default (Wan, FLUX.2 klein).
            negative_prompt="blurry" if cfg.cfg > 1 and "negative_prompt" in takes else None,
            true_cfg_scale=2.0 if cfg.cfg > 1 and "true_cfg_scale" in takes else None,
            width=width,
            height=height,
            num_inference_steps=cfg.warmup_steps,
            seed=[0],
            video=clip,
            edit=p.EditInput(images=[0]) if needs_image else None,
        )
        if startup is not None:
            compiling = ", compiling its graph" if compiler is not None else ""
            startup.say("warming up at %dx%d%s", width, height, compiling)
        started = time.perf_counter()
        warmup = [Generation(id="warmup", params=params)]
        [reply] = executor.generate_batch(warmup, [0.0], None, blobs)
        if reply is not None and reply.kind == p.ERROR:
            raise RuntimeError(f"warmup failed: {reply.body}")
        log.info("warmup at %dx%d done in %.2fs", width, height, time.perf_counter() - started)
    if compiler is not None:
        compiler.seal(compiled_before)
        facts = executor.ops.info
        assert facts is not None  # set by build_executor
        executor.ops.info = msgspec.structs.replace(facts, compile=compiler.info())
    # A warm-up pays first-call costs (and compiles): no measure of a request. An
    # uncalibrated replica borrows the others' figure, so it is not passed over until
    # its own traffic calibrates it (dpserve.contract.cost, docs/router.md).
    executor.status.calibration.forget()


def open_driver(cfg: WorkerConfig, executor: Executor) -> Driver:
    from dpserve.plumbing.curve import WireKey
    from dpserve.sources.outstore import VideoObjects
    from dpserve.worker.batch import Batching
    from dpserve.worker.driver import Driver
    from dpserve.worker.driver.read_ahead import ReadAhead
    from dpserve.worker.paths import AllowedPaths
    from dpserve.worker.video_jobs import VideoBook

    facts = executor.ops.info
    assert facts is not None  # set by build_executor
    limits = facts.limits()  # the router checks with the same (dpserve.contract.model_info)
    driver = Driver(
        cfg.endpoint,
        cfg.replica,
        limits,
        executor.status,
        cfg.max_queue,
        cfg.stall_s,
        cfg.max_sessions,
        settle=cfg.endpoint_file is not None,  # only a caller that reads it back may move it
        key=None if cfg.wire_key_file is None else WireKey.load(cfg.wire_key_file),
        features=executor.features,
        batching=Batching(cfg.max_batch, cfg.batch_wait_ms / 1000),
        # A video model's jobs and their files (docs/video.md).
        videos=VideoBook(
            cfg.video_dir,
            cfg.video_ttl_s,
            cfg.video_max_bytes,
            cfg.replica,
            objects=None if cfg.output_store is None else VideoObjects(cfg.output_store),
        )
        if limits.max_frames
        else None,
        # Adapter files read while the gang works, from the folders it may load (docs/lora.md).
        read_ahead=ReadAhead(AllowedPaths.of(cfg.model, cfg.allow_paths)),
    )
    executor.status.max_batch = cfg.max_batch
    if not driver.endpoint.endswith(f":{cfg.port}"):
        taken = "replica %d: port %d is taken; bound %s instead"
        log.warning(taken, cfg.replica, cfg.port, driver.endpoint)
    driver.start()
    if cfg.endpoint_file is not None:
        _write_atomically(cfg.endpoint_file, driver.endpoint + "\n")
    log.info(
        "replica %d ready: %s on %s (gang of %d)",
        cfg.replica,
        describe(cfg.parallel),
        driver.endpoint,
        cfg.gang_size,
    )
    return driver


def _write_atomically(path: Path, text: str) -> None:
    """A reader polling ``path`` sees nothing or all of ``text``, never a part."""
    partial = path.with_name(f".{path.name}.{os.getpid()}")
    partial.write_text(text)
    os.replace(partial, path)
