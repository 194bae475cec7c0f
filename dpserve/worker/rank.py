"""One rank of a replica's gang: join the group, load the model, warm up, serve.

The driver (first rank) owns the driver's parts (worker/driver/) and relays one
command per loop turn, from its scheduler, to the whole gang with a broadcast over
the gang's CPU group (a batch of generations is one command: worker/batch.py); every
rank executes it; only the driver answers, through its output path.
When idle the driver relays a tick, so a dead rank shows within one tick interval
and idle collectives never time out (a stopped one does not, a broadcast waits for
no receiver: the supervisor's heartbeats find it).
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from dpserve.config.worker import WorkerConfig
from dpserve.contract import protocol as p
from dpserve.contract import realtime as rt
from dpserve.plumbing.proc import RANK_PROCESS_PREFIX, die_with_parent, name_this_process
from dpserve.worker import boot
from dpserve.worker.commands import STOP, TICK, GangCommand, decode_command
from dpserve.worker.commands import encode_command as _encode
from dpserve.worker.heartbeat import Heartbeats
from dpserve.worker.startup import StartupLog, folder_size

if TYPE_CHECKING:
    from dpserve.worker.driver import Driver
    from dpserve.worker.driver.outbox import Outbox
    from dpserve.worker.driver.work_queue import Work
    from dpserve.worker.executor import Executor
    from dpserve.worker.reply import Reply

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
    name_this_process(f"{RANK_PROCESS_PREFIX}{args.rank}")
    # The supervisor died before we could ask: its sentinel, not our parent's PID, says
    # so (a CPU gang's ranks are forked by a server process, and in a container the
    # supervisor is PID 1). That server exits with the supervisor, and we with it.
    parent = mp.parent_process()
    if parent is None or not parent.is_alive():
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
        versions = boot.import_libraries(cfg.model)
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
    comm.info = boot.with_replica(comm.info, cfg.replica)
    dtype = resolve_dtype(cfg.dtype, device)
    startup.say("loading %s (%s) on %s as %s", cfg.model, folder_size(cfg.model), device, dtype)
    try:
        with startup.phase("load"):
            executor = boot.build_executor(cfg, comm, device, dtype)
    except ParallelUnsupported as exc:  # every rank finds the same: refuse, no traceback
        log.error("replica %d cannot start: %s", cfg.replica, exc)
        return 2
    with startup.phase("warm-up"):
        boot.warmup(executor, cfg, startup)
    driver = boot.open_driver(cfg, executor) if comm.info.is_driver else None
    startup.say("%s", startup.summary())  # after the driver's "replica r ready: … on …"
    try:
        _loop(comm, executor, driver, cfg, drain_asked)
    finally:
        if driver is not None:
            driver.close()
    torch.distributed.destroy_process_group()
    log.info("rank %d stopped", args.rank)
    return 0


def _next_command(
    driver: Driver, executor: Executor, cfg: WorkerConfig, drain_asked: threading.Event
) -> tuple[GangCommand, list[Work]]:
    """The driver's choice for this turn: an expiry, queued work (a batch), a tick, or
    STOP once drained; with the queued work it runs (none for the driver's own)."""
    expired = executor.sessions.expired(time.monotonic())
    if expired:
        # The driver's clock decides, and the whole gang drops the session together.
        log.info("session %s idle for %gs: released", expired[0], cfg.session_idle_timeout_s)
        close = rt.SessionRequest(action=rt.CLOSE, session_id=expired[0])
        return GangCommand(kind=p.SESSION, id="expiry", session=close), []
    scheduler = driver.scheduler
    if drain_asked.is_set() and not driver.draining.is_set():
        log.info("draining: no new requests, finishing %d queued", scheduler.work.qsize())
        driver.draining.set()
    # Short waits up to one tick, so a drain request is noticed promptly.
    deadline = time.monotonic() + cfg.tick_s
    batch = scheduler.next_batch(timeout=0)
    while not batch and not drain_asked.is_set() and time.monotonic() < deadline:
        batch = scheduler.next_batch(timeout=0.25)
    if len(batch) > 1:  # compatible generations: one command, one pipeline call
        generations = [g for work in batch for g in work.command.batch]
        return GangCommand(kind=p.GENERATE, id=batch[0].command.id, batch=generations), batch
    if batch:
        return batch[0].command, batch
    return GangCommand(kind=STOP if driver.draining.is_set() else TICK), []


def _loop(
    comm: Any,
    executor: Executor,
    driver: Driver | None,
    cfg: WorkerConfig,
    drain_asked: threading.Event,
) -> None:
    """Every rank's loop; ``driver`` is the driver rank's own (None on the others)."""
    status = executor.status
    while True:
        status.progress_at = time.monotonic()
        works: list[Work] = []  # the driver's: the queued work this turn runs
        payload = None
        if driver is not None:
            command, works = _next_command(driver, executor, cfg, drain_asked)
            payload = _encode(command)
        command = decode_command(comm.broadcast_bytes(payload))
        if command.kind == STOP:
            return
        if command.kind == TICK:
            continue
        status.busy = True
        replies: list[Reply | None] | list[list[bytes]]
        if command.batch:
            # The driver's scheduler says, at each denoising step, whether the work goes on.
            halt = driver.scheduler.halt if driver is not None else None
            emit = _emitter(driver.outbox, works) if driver is not None else None
            now = time.monotonic()
            queue_s = [now - work.received_at for work in works] or [0.0] * len(command.batch)
            replies = executor.generate_batch(command.batch, queue_s, halt, command.blobs, emit)
        elif command.session is not None:
            replies = [executor.session(command.id, command.session, command.blobs)]
        else:
            assert command.control is not None
            replies = [executor.control(command.id, command.control, cfg.replica)]
        status.busy = False
        # The driver's own commands (expiries) get no reply and are no served requests.
        status.served += len(works) if driver is not None else 1
        if driver is not None:
            driver.scheduler.finished(replies if works else [])


def _emitter(outbox: Outbox, works: list[Work]) -> Callable[[Reply], None] | None:
    """The driver's way to deliver a request's interim replies (previews, a video's
    progress) as they come; only a batch of one request has any (worker/batch.py).

    Called on this, the gang loop's, thread: the output path hands a client's frames
    to the socket thread, which alone touches the socket.
    """
    if len(works) != 1:
        return None
    to = works[0].to
    return lambda reply: outbox.answer(to, reply)
