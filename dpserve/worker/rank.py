"""One rank of a replica's gang: join the group, load the model, warm up, serve.

The driver (first rank) owns the ingress and relays one command per loop turn to
the whole gang with a broadcast over the gang's CPU group (a batch of generations
is one command: worker/batch.py); every rank executes it; only the driver replies.
When idle the driver relays a tick, so a dead rank shows within one tick interval
and idle collectives never time out (a stopped one does not, a broadcast waits for
no receiver: the supervisor's heartbeats find it).
"""

from __future__ import annotations

import dataclasses
import logging
import multiprocessing as mp
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import msgspec

from dpserve.config.worker import WorkerConfig
from dpserve.contract import protocol as p
from dpserve.contract import realtime as rt
from dpserve.contract.layout import describe
from dpserve.plumbing.proc import die_with_parent
from dpserve.worker.commands import STOP, TICK, GangCommand, GangStatus, decode_command
from dpserve.worker.commands import encode_command as _encode
from dpserve.worker.heartbeat import Heartbeats
from dpserve.worker.startup import StartupLog, folder_size

if TYPE_CHECKING:
    from dpserve.worker.compile import Compiler
    from dpserve.worker.executor import Executor
    from dpserve.worker.ingress import Ingress, Work
    from dpserve.worker.parallel.encoders import EncoderRelay
    from dpserve.worker.step_cache import StepCaches

log = logging.getLogger("dpserve.worker")


@dataclass(frozen=True)
class RankArgs:
    config: WorkerConfig
    rank: int
    store_path: str
    heartbeats: Heartbeats


def rank_main(args: RankArgs) -> None:
    """Process entry point (multiprocessing spawn target)."""
    die_with_parent()
    parent = mp.parent_process()
    # Reparented: the supervisor died before we could ask. (Not "parent is PID 1":
    # in a container the supervisor is PID 1.)
    if parent is None or os.getppid() != parent.pid:
        sys.exit(1)
    cfg = args.config
    # First of all: loading the model takes long, and the supervisor counts silence.
    args.heartbeats.beat_forever(args.rank, cfg.hang_timeout_s)
    _thread_lock_for_progress_bars()
    logging.basicConfig(
        level=logging.INFO,
        format=f"%(asctime)s replica{cfg.replica}/rank{args.rank} %(levelname)s %(message)s",
    )
    # The supervisor coordinates shutdown: SIGTERM/SIGINT reach the driver only
    # through it, and the other ranks stop when the driver relays STOP.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    drain_asked = threading.Event()  # SIGTERM: finish what is queued, take nothing new
    if args.rank == 0:
        signal.signal(signal.SIGTERM, lambda *_: drain_asked.set())
    else:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    code = _serve(args, drain_asked)
    # A clean stop leaves nothing to finalize, and the interpreter's finalization
    # can abort (SIGABRT, "terminate called without an active exception") when a
    # collective library's thread is still joinable, which would turn a clean drain
    # into a failed gang: flush and leave at once.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _thread_lock_for_progress_bars() -> None:
    """Give tqdm (diffusers' progress bars) a thread lock before any bar exists.

    Its default lock holds a multiprocessing semaphore, which only the
    interpreter's finalization unlinks: a rank leaves by ``os._exit``, so each one
    left a semaphore behind, and the resource tracker warned about it when the
    worker stopped. A rank's bars never share a terminal line with another process,
    so a thread lock is all they need.
    """
    from tqdm import tqdm

    tqdm.set_lock(threading.RLock())


def _serve(args: RankArgs, drain_asked: threading.Event) -> int:
    cfg = args.config
    startup = StartupLog(log, speaks=args.rank == 0)
    startup.say("importing torch, diffusers and transformers")
    with startup.phase("imports"):
        versions = _import_libraries(cfg.model)
    startup.say("imported %s in %.1fs", versions, startup.took["imports"])
    import torch

    torch.set_num_threads(cfg.threads_per_rank)
    from dpserve.worker.comm import init_gang
    from dpserve.worker.parallel import ParallelUnsupported
    from dpserve.worker.pipeline import resolve_device, resolve_dtype

    device = resolve_device(cfg.device, args.rank, cfg.first_gpu)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    with startup.phase("gang"):
        comm = init_gang(cfg.parallel, args.rank, args.store_path, device, cfg.collective_timeout_s)
    if cfg.gang_size > 1:
        startup.say("joined the gang of %d ranks in %.1fs", cfg.gang_size, startup.took["gang"])
    comm.info = _with_replica(comm.info, cfg.replica)
    dtype = resolve_dtype(cfg.dtype, device)
    startup.say("loading %s (%s) on %s as %s", cfg.model, folder_size(cfg.model), device, dtype)
    try:
        with startup.phase("load"):
            executor = _build_executor(cfg, comm, device, dtype)
    except ParallelUnsupported as exc:  # every rank finds the same: refuse, no traceback
        log.error("replica %d cannot start: %s", cfg.replica, exc)
        return 2
    with startup.phase("warm-up"):
        _warmup(executor, cfg, startup)
    ingress = _open_ingress(cfg, executor) if comm.info.is_driver else None
    startup.say("%s", startup.summary())  # after the ingress's "replica r ready: … on …"
    try:
        _loop(comm, executor, ingress, cfg, drain_asked)
    finally:
        if ingress is not None:
            ingress.close()
    torch.distributed.destroy_process_group()
    log.info("rank %d stopped", args.rank)
    return 0


def _import_libraries(model: Path) -> str:
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
        name = json.loads((model / "model_index.json").read_text())["_class_name"]
        getattr(diffusers, name)
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        pass  # a custom or broken pipeline: the load says what is wrong
    return (
        f"torch {torch.__version__}, diffusers {diffusers.__version__}, "
        f"transformers {transformers.__version__}"
    )


def _with_replica(info: Any, replica: int) -> Any:
    import dataclasses

    return dataclasses.replace(info, replica=replica)


def _build_executor(cfg: WorkerConfig, comm: Any, device: Any, dtype: Any) -> Executor:
    from dpserve.contract.model_info import GangShape, ReplicaFacts
    from dpserve.worker.control import ControlOps
    from dpserve.worker.executor import Executor
    from dpserve.worker.parallel import ModelParallel, ParallelUnsupported
    from dpserve.worker.pipeline import call_defaults, load_pipeline, size_factor
    from dpserve.worker.sessions import SessionLimits

    parallel = ModelParallel(comm.info, comm.model_groups, cfg.parallel)
    relay = _encoder_relay(cfg, comm)
    started = time.perf_counter()
    skip = relay.skipped() if relay is not None else None
    pipe = load_pipeline(cfg.model, device, dtype, parallel.prepare, skip)
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
    caches, compiler = _accel(cfg, pipe)
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
    )
    if cfg.cfg > 1 and not executor.split_ok:
        # Its second rank would only redo the first one's work.
        raise ParallelUnsupported(
            f"--cfg {cfg.cfg} needs a denoiser that marks its two guidance branches "
            f"(cache_context, as diffusers' true-CFG pipelines do); "
            f"{type(pipe).__name__}'s does not: use --cfg 1 and more replicas"
        )
    # Requests without true CFG: split over the CFG ranks' sequence too, or run twice.
    # (Never a compiled or step-cached call: executor._wrap.)
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


def _accel(cfg: WorkerConfig, pipe: Any) -> tuple[StepCaches, Compiler | None]:
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


def _encoder_relay(cfg: WorkerConfig, comm: Any) -> EncoderRelay | None:
    """Gangs of more than one rank keep the text encoders on the output rank only."""
    import json

    from dpserve.worker.parallel.encoders import EncoderRelay, encoder_names

    if cfg.gang_size == 1:
        return None
    index = json.loads((cfg.model / "model_index.json").read_text())
    return EncoderRelay(encoder_names(index), comm.info.is_output_rank, comm.broadcast_bytes)


def _warmup(executor: Executor, cfg: WorkerConfig, startup: StartupLog | None = None) -> None:
    """Generations through the real path (CFG split included) before serving: one small
    one (a video model's: 5 frames), or with --compile one at each compile size, which
    compiles its graph there (worker/compile.py); then the compiler is sealed."""
    from dpserve.worker.compile import graphs
    from dpserve.worker.pipeline import size_factor
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
    clip = (
        None
        if video is None
        else p.VideoSpec(num_frames=min(5, video.max_frames), fps=video.default_fps)
    )
    for width, height in sizes:
        # An image-to-video model's warm-up animates a grey image.
        needs_image = video is not None and not video.text_to_video
        blobs = [warmup_reference(width, height)] if needs_image else []
        params = p.GenerateParams(
            prompt="warmup",
            negative_prompt="blurry" if cfg.cfg > 1 else None,
            # A video model's CFG is its guidance_scale, on by default.
            true_cfg_scale=2.0 if cfg.cfg > 1 and video is None else None,
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
        frames = executor.generate("warmup", params, 0.0, None, blobs)
        if frames and p.decode(frames).kind == p.ERROR:
            raise RuntimeError(f"warmup failed: {p.decode_error(p.decode(frames))}")
        log.info("warmup at %dx%d done in %.2fs", width, height, time.perf_counter() - started)
    if compiler is not None:
        compiler.seal(compiled_before)
        facts = executor.ops.info
        assert facts is not None  # set by _build_executor
        executor.ops.info = msgspec.structs.replace(facts, compile=compiler.info())
    # A warm-up pays first-call costs (and compiles): no measure of a request. An
    # uncalibrated replica borrows the others' figure, so it is not passed over until
    # its own traffic calibrates it (dpserve.contract.cost, docs/router.md).
    executor.status.calibration.forget()


def _open_ingress(cfg: WorkerConfig, executor: Executor) -> Ingress:
    from dpserve.plumbing.curve import WireKey
    from dpserve.worker.batch import Batching
    from dpserve.worker.ingress import Ingress
    from dpserve.worker.video_jobs import VideoBook

    facts = executor.ops.info
    assert facts is not None  # set by _build_executor
    limits = facts.limits()  # the router checks with the same (dpserve.contract.model_info)
    ingress = Ingress(
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
        videos=VideoBook(cfg.video_dir, cfg.video_ttl_s, cfg.video_max_bytes, cfg.replica)
        if limits.max_frames
        else None,
    )
    executor.status.max_batch = cfg.max_batch
    if not ingress.endpoint.endswith(f":{cfg.port}"):
        taken = "replica %d: port %d is taken; bound %s instead"
        log.warning(taken, cfg.replica, cfg.port, ingress.endpoint)
    ingress.start()
    if cfg.endpoint_file is not None:
        _write_atomically(cfg.endpoint_file, ingress.endpoint + "\n")
    log.info(
        "replica %d ready: %s on %s (gang of %d)",
        cfg.replica,
        describe(cfg.parallel),
        ingress.endpoint,
        cfg.gang_size,
    )
    return ingress


def _write_atomically(path: Path, text: str) -> None:
    """A reader polling ``path`` sees nothing or all of ``text``, never a part."""
    partial = path.with_name(f".{path.name}.{os.getpid()}")
    partial.write_text(text)
    os.replace(partial, path)


def _next_command(
    ingress: Ingress, executor: Executor, cfg: WorkerConfig, drain_asked: threading.Event
) -> tuple[GangCommand, list[Work]]:
    """The driver's choice for this turn: an expiry, queued work (a batch), a tick, or
    STOP once drained; with the queued work it runs (none for the driver's own)."""
    expired = executor.sessions.expired(time.monotonic())
    if expired:
        # The driver's clock decides, and the whole gang drops the session together.
        log.info("session %s idle for %gs: released", expired[0], cfg.session_idle_timeout_s)
        close = rt.SessionRequest(action=rt.CLOSE, session_id=expired[0])
        return GangCommand(kind=p.SESSION, id="expiry", session=close), []
    if drain_asked.is_set() and not ingress.draining.is_set():
        log.info("draining: no new requests, finishing %d queued", ingress.work.qsize())
        ingress.draining.set()
    # Short waits up to one tick, so a drain request is noticed promptly.
    deadline = time.monotonic() + cfg.tick_s
    batch = ingress.next_work(timeout=0)
    while not batch and not drain_asked.is_set() and time.monotonic() < deadline:
        batch = ingress.next_work(timeout=0.25)
    if len(batch) > 1:  # compatible generations: one command, one pipeline call
        generations = [g for work in batch for g in work.command.batch]
        return GangCommand(kind=p.GENERATE, id=batch[0].command.id, batch=generations), batch
    if batch:
        return batch[0].command, batch
    return GangCommand(kind=STOP if ingress.draining.is_set() else TICK), []


def _loop(
    comm: Any,
    executor: Executor,
    ingress: Ingress | None,
    cfg: WorkerConfig,
    drain_asked: threading.Event,
) -> None:
    status = executor.status
    while True:
        status.progress_at = time.monotonic()
        works: list[Work] = []  # the driver's: the queued work this turn runs
        payload = None
        if ingress is not None:
            command, works = _next_command(ingress, executor, cfg, drain_asked)
            payload = _encode(command)
        command = decode_command(comm.broadcast_bytes(payload))
        if command.kind == STOP:
            return
        if command.kind == TICK:
            continue
        status.busy = True
        if command.batch:
            # The driver's ingress says, at each denoising step, whether the work goes on.
            halt = ingress.halt if ingress is not None else None
            now = time.monotonic()
            queue_s = [now - work.received_at for work in works] or [0.0] * len(command.batch)
            replies = executor.generate_batch(
                command.batch, queue_s, halt, command.blobs, _emitter(ingress, works)
            )
        elif command.session is not None:
            replies = [executor.session(command.id, command.session, command.blobs)]
        else:
            assert command.control is not None
            replies = [executor.control(command.id, command.control, cfg.replica)]
        status.busy = False
        # The driver's own commands (expiries) get no reply and are no served requests.
        status.served += len(works) if ingress is not None else 1
        if ingress is not None:
            ingress.finished(replies if works else [])


def _emitter(ingress: Ingress | None, works: list[Work]) -> Callable[[list[bytes]], None] | None:
    """The driver's way to send a request's interim replies (previews) as they come;
    only a batch of one request has any (worker/batch.py).

    Called on this, the gang loop's, thread: ``Ingress.reply`` hands the frames to
    the ingress thread, which alone touches the socket.
    """
    if ingress is None or len(works) != 1:
        return None
    identity = works[0].identity
    return lambda frames: ingress.reply(identity, frames)
