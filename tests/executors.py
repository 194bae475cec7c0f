"""Real executors in the test's own process: a one-rank gloo gang and the rank's own
builder, without the gang loop or the ingress (tests/workers.py runs whole workers).
Torch is imported when called, so a module that skips without it can import this."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dpserve.config.worker import WorkerConfig
from dpserve.contract import protocol as p

if TYPE_CHECKING:
    from dpserve.worker.executor import Executor


@contextmanager
def one_rank_executors(
    configs: Sequence[WorkerConfig], store_dir: Path
) -> Iterator[list[Executor]]:
    """An executor for each of ``configs`` (one model, one layout), all on one one-rank
    gang on the CPU in float32, torch at one thread as a worker's rank runs (the bytes
    depend on it); the gang and the thread count are undone on exit."""
    import torch
    import torch.distributed as dist

    from dpserve.worker.boot import build_executor as _build_executor
    from dpserve.worker.comm import init_gang

    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    device = torch.device("cpu")
    comm = init_gang(configs[0].parallel, 0, str(store_dir / "store"), device, 60.0)
    try:
        yield [_build_executor(cfg, comm, device, torch.float32) for cfg in configs]
    finally:
        dist.destroy_process_group()
        torch.set_num_threads(threads)


def reply_to(
    executor: Executor,
    fields: dict[str, Any],
    blobs: Sequence[bytes] = (),
    emit: Callable[[list[bytes]], None] | None = None,
) -> p.Message:
    """The executor's final reply to one request of ``fields`` (uploads ``blobs``,
    previews to ``emit``); an error reply is raised as the error it carries."""
    params = p.GenerateParams(**fields)
    reply = p.decode(executor.generate("r", params, 0.0, None, blobs, emit))
    if reply.kind == p.ERROR:
        raise p.decode_error(reply)
    return reply
