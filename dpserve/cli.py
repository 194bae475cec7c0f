"""The ``dpserve`` command line; each subcommand imports only what it needs."""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence
from pathlib import Path

from dpserve.layout import LayoutError


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def _port(text: str) -> int:
    value = int(text)
    if not 1 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"must be a port in 1..65535, got {value}")
    return value


def _add_worker(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    w = sub.add_parser("worker", help="run one replica: a gang of ranks behind a ZMQ endpoint")
    w.add_argument("--model", type=Path, required=True, help="diffusers pipeline folder")
    w.add_argument("--port", type=_port, required=True, help="ZMQ port the driver binds")
    w.add_argument("--bind", default="127.0.0.1", help="address the driver binds (0.0.0.0: all)")
    w.add_argument("--tp", type=_positive, default=1, help="tensor-parallel degree")
    w.add_argument("--sp", type=_positive, default=1, help="sequence-parallel degree")
    w.add_argument("--ulysses", type=_positive, default=None, help="Ulysses part of --sp")
    w.add_argument("--ring", type=_positive, default=None, help="ring part of --sp")
    w.add_argument("--cfg", type=_positive, default=1, help="CFG-parallel degree (1 or 2)")
    w.add_argument("--replica", type=int, default=0, help="replica index reported in replies")
    w.add_argument("--threads-per-rank", type=_positive, default=1, help="torch threads per rank")
    w.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    w.add_argument("--dtype", choices=("auto", "float32", "bfloat16", "float16"), default="auto")
    w.add_argument("--max-queue", type=_positive, default=64, help="queued requests per replica")
    w.add_argument("--max-side", type=_positive, default=2048, help="largest width/height")
    w.add_argument("--max-steps", type=_positive, default=100, help="most inference steps")
    w.add_argument(
        "--max-sequence-length", type=_positive, default=None, help="text tokens per prompt"
    )
    w.add_argument("--drain-timeout", type=float, default=300.0, help="seconds to finish work")


def _add_tiny(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    t = sub.add_parser("make-tiny-model", help="build a tiny Flux-style pipeline (random weights)")
    t.add_argument("dir", type=Path)
    t.add_argument("--variant", choices=("tiny", "small"), default="tiny")
    t.add_argument("--seed", type=int, default=0)
    lora = sub.add_parser("make-tiny-lora", help="build a random LoRA for a tiny model")
    lora.add_argument("dir", type=Path)
    lora.add_argument("--model", type=Path, required=True)
    lora.add_argument("--seed", type=int, default=0)
    lora.add_argument("--rank", type=_positive, default=4)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="dpserve", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    _add_worker(sub)
    _add_tiny(sub)
    sub.add_parser("serve", help="embedded default: N replicas and a router (not yet)")
    return parser


def _worker(args: argparse.Namespace) -> int:
    from dpserve.worker.config import WorkerConfig
    from dpserve.worker.gang import run_gang

    config = WorkerConfig(
        model=args.model,
        port=args.port,
        bind=args.bind,
        tp=args.tp,
        sp=args.sp,
        ulysses=args.ulysses,
        ring=args.ring,
        cfg=args.cfg,
        replica=args.replica,
        threads_per_rank=args.threads_per_rank,
        device=args.device,
        dtype=args.dtype,
        max_queue=args.max_queue,
        max_side=args.max_side,
        max_steps=args.max_steps,
        drain_timeout_s=args.drain_timeout,
        max_sequence_length=args.max_sequence_length,
    )
    if not (config.model / "model_index.json").is_file():
        print(f"dpserve worker: {config.model} is not a diffusers pipeline folder", file=sys.stderr)
        return 2
    return run_gang(config)


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    try:
        if args.command == "worker":
            return _worker(args)
        if args.command == "make-tiny-model":
            from dpserve.worker.tiny_model import build_tiny_pipeline

            print(build_tiny_pipeline(args.dir, variant=args.variant, seed=args.seed))
            return 0
        if args.command == "make-tiny-lora":
            from dpserve.worker.tiny_model import build_tiny_lora

            print(build_tiny_lora(args.dir, args.model, seed=args.seed, rank=args.rank))
            return 0
        print("dpserve serve: not yet — the router lands with the next issue", file=sys.stderr)
        return 2
    except LayoutError as exc:
        print(f"dpserve {args.command}: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
