"""What the stop gate costs a CFG-parallel gang: one byte broadcast per denoising step.

Two gloo ranks (one thread each) load the model and run the same request with the
gate and without it, alternating, so drift on the machine hits both alike; the gate
alone is timed too. True CFG takes the split path (the gate skips its second
branch); without it the CFG ranks share the tokens. Last line:
``gate_us=<median µs per gate call> step_ms=<ms per step> overhead=<fraction of a step>``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch
import torch.multiprocessing as mp

from bench.common import cached_model


def _rank(rank: int, model: str, args: dict[str, Any], store: str, out: str) -> None:
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    torch.set_num_threads(1)
    import torch.distributed as dist

    from dpserve.contract.layout import ParallelConfig
    from dpserve.contract.protocol import (
        GenerateParams,
    )
    from dpserve.worker.comm import init_gang
    from dpserve.worker.denoiser import DenoiserPatch, StopGate
    from dpserve.worker.parallel import ModelParallel
    from dpserve.worker.pipeline import call_defaults, cfg_requested, load_pipeline, pipeline_kwargs

    layout = ParallelConfig(cfg=2)
    comm = init_gang(layout, rank, store, torch.device("cpu"), 120.0)
    parallel = ModelParallel(comm.info, comm.model_groups, layout)
    pipe = load_pipeline(Path(model), torch.device("cpu"), torch.float32, parallel.prepare)
    request: dict[str, Any] = {
        "prompt": "a watercolor lighthouse at dusk",
        "width": args["size"],
        "height": args["size"],
        "num_inference_steps": args["steps"],
        "seed": [1],
    }
    if args["true_cfg"]:
        request.update(negative_prompt="blurry", true_cfg_scale=4.0)
    params = GenerateParams(**request)
    defaults = call_defaults(pipe)
    kwargs = {**pipeline_kwargs(params, defaults, "latent"), "max_sequence_length": 77}
    patch = DenoiserPatch(comm.info.cfg_rank, comm.cfg_group, lambda: None, parallel.wrap)
    split = patch.can_split(pipe.transformer) and cfg_requested(params, defaults)
    check = (lambda: None) if rank == 0 else None

    def run(gated: bool) -> float:
        gate = StopGate(comm.cpu_group, 0, check) if gated else None
        dist.barrier(comm.cpu_group)
        start = time.perf_counter()
        with torch.inference_mode(), patch.applied(pipe.transformer, split, gate):
            pipe(**kwargs)
        return time.perf_counter() - start

    run(True)  # first-call effects out of the timed rounds
    times: dict[bool, list[float]] = {True: [], False: []}
    for _ in range(args["rounds"]):
        for gated in (False, True):
            times[gated].append(run(gated))
    gate = StopGate(comm.cpu_group, 0, check)
    calls = []
    for _ in range(2000):
        dist.barrier(comm.cpu_group)
        start = time.perf_counter()
        gate()
        calls.append(time.perf_counter() - start)
    if rank == 0:
        steps = args["steps"]
        plain = statistics.median(times[False]) / steps
        gated = statistics.median(times[True]) / steps
        gate_s = statistics.median(calls)
        torch.save({"plain": plain, "gated": gated, "gate": gate_s}, out)
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--variant", default="tiny", choices=("tiny", "small"))
    parser.add_argument("--size", type=int, default=128)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--true-cfg", action="store_true")
    args = parser.parse_args()
    model = cached_model(args.variant)
    with tempfile.TemporaryDirectory(prefix="dpserve-gate-") as tmp:
        out = os.path.join(tmp, "times.pt")
        spawn_args = (str(model), vars(args), os.path.join(tmp, "store"), out)
        mp.start_processes(_rank, args=spawn_args, nprocs=2, start_method="spawn")
        got = torch.load(out)
    overhead = (got["gated"] - got["plain"]) / got["plain"]
    print(
        f"per step without the gate {got['plain'] * 1e3:.2f} ms, "
        f"with it {got['gated'] * 1e3:.2f} ms"
    )
    print(
        f"gate_us={got['gate'] * 1e6:.0f} step_ms={got['plain'] * 1e3:.2f} "
        f"overhead={overhead:+.3f} gate_share={got['gate'] / got['plain']:.4f}"
    )


if __name__ == "__main__":
    main()
