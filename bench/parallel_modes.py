"""Parallel modes of one replica's gang: latency of each 2-rank layout vs one rank,
for one model family (``--family``: its small tiny variant, ``bench/families.py``;
``wan``, a video family, runs ``bench/video_parallel.py``).

One replica per layout runs at once: ``single`` (``--cfg 1``), ``cfg2``
(``--cfg 2``), ``ulysses2`` (``--sp 2 --ulysses 2``), ``ring2`` (``--sp 2 --ring
2``) and ``tp2`` (``--tp 2``), one thread per rank. Every layout gets the same
CFG request (a negative prompt and ``true_cfg_scale``, or ``guidance_scale`` where
that is the family's CFG), so cfg2 has two branches to split and the others do the
same work. Idle replicas only tick
through their gang every 2 s, so all of them stay up and each round asks each
layout once, in turn: drift on the machine hits every layout alike, and only one
gang computes at a time. A measurement during which other processes used more
than ``--max-foreign`` cores (a noisy neighbour) is dropped, as in
``bench/cfg_parallel.py``; each layout's median is over what is left.

``<layout>=<x>`` is ``t_single / t_layout`` (above 1: the layout is faster than
one rank). ``tp2_weights`` is the largest per-rank transformer weight bytes of the
tp2 gang over one rank's, from the ``rank_weights`` field of ``model_info``
(``nan`` when the worker does not report it). Also printed, before the last line:
each layout's peak memory (``peak_memory_mb`` of the reply: the largest over the gang's ranks),
cfg2's speed-up on a request without true CFG (its CFG ranks then split the tokens)
and how far its image is from the single rank's.

Last line: ``family=<f> cfg2=<x> ulysses2=<y> ring2=<z> tp2=<w> tp2_weights=<r>``.
"""

from __future__ import annotations

import argparse
import io
import math
import sys
from contextlib import ExitStack
from functools import partial
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import cached_model, median, one_request, rank_processes, timed_round
from bench.families import FAMILIES, cfg_fields, plain_fields
from dpserve.local import WorkerProcess

LAYOUTS: dict[str, tuple[str, ...]] = {
    "single": ("--cfg", "1"),
    "cfg2": ("--cfg", "2"),
    "ulysses2": ("--sp", "2", "--ulysses", "2"),
    "ring2": ("--sp", "2", "--ring", "2"),
    "tp2": ("--tp", "2"),
}
PARALLEL = tuple(name for name in LAYOUTS if name != "single")
PLAIN_LAYOUTS = ("single", "cfg2")  # also timed on a request without true CFG


def transformer_bytes(info: dict[str, Any]) -> list[int] | None:
    """Per-rank transformer weight bytes (rank order) from a ``model_info`` answer.

    The worker reports ``"rank_weights": [{"rank": 0, "tp_rank": 0, "bytes":
    {"transformer": N, ...}}, ...]``; None when it reports no such field.
    """
    ranks = info.get("rank_weights")
    if not ranks:
        return None
    ordered = sorted(ranks, key=lambda r: int(r["rank"]))
    return [int(r["bytes"]["transformer"]) for r in ordered]


def weight_ratios(infos: dict[str, dict[str, Any]]) -> dict[str, float]:
    """Largest per-rank transformer bytes of each layout over the single rank's (nan: unknown)."""
    base = transformer_bytes(infos["single"])
    ratios: dict[str, float] = {}
    for name in PARALLEL:
        ranks = transformer_bytes(infos[name]) if name in infos else None
        ratios[name] = max(ranks) / base[0] if base and ranks else math.nan
    return ratios


def pixel_difference(a: bytes, b: bytes) -> float:
    """Largest per-pixel difference of two PNGs as a fraction of full scale (0: the same)."""
    import numpy as np
    from PIL import Image

    pa = np.asarray(Image.open(io.BytesIO(a)).convert("RGB"), dtype=np.int16)
    pb = np.asarray(Image.open(io.BytesIO(b)).convert("RGB"), dtype=np.int16)
    if pa.shape != pb.shape:
        return math.inf
    return float(np.abs(pa - pb).max()) / 255.0


def start(
    stack: ExitStack, model: Path, worker_args: tuple[str, ...]
) -> tuple[dict[str, WorkerProcess], dict[str, str]]:
    """Every layout's replica, started at once (start-up is the slow part) and waited for in
    turn; a layout that cannot start is reported by name (``failed``) and left out."""
    workers = {
        name: stack.enter_context(WorkerProcess(model, *flags, *worker_args, wait=False))
        for name, flags in LAYOUTS.items()
    }
    failed: dict[str, str] = {}
    for name, worker in workers.items():
        try:
            worker.wait_ready(timeout_s=900)
        except (RuntimeError, TimeoutError) as exc:
            failed[name] = f"{' '.join(LAYOUTS[name])}: {exc}"
    if "single" in failed:
        raise SystemExit(f"the single-rank replica did not start ({failed['single']})")
    return {n: w for n, w in workers.items() if n not in failed}, failed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--family", default="flux", choices=sorted(FAMILIES))
    parser.add_argument("--variant", help="a tiny variant of the family (default: its small)")
    parser.add_argument("--size", type=int, help="width and height (the family's)")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--max-sequence-length", type=int, help="text tokens (family's)")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--dtype", default="auto", help="worker --dtype")
    parser.add_argument("--max-foreign", type=float, default=0.15, help="cores used by others")
    parser.add_argument("--model", type=Path, default=None, help="default: the cached variant")
    args, rest = parser.parse_known_args()
    family = FAMILIES[args.family]
    if family.video:
        from bench.video_parallel import main as video_main

        video_main(["--variant", args.variant or family.variant, *rest], args.family)
        return
    if rest:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    args.variant = args.variant or family.variant
    args.size = args.size or family.size
    text_tokens = args.max_sequence_length or family.text_tokens
    model = args.model or cached_model(args.variant)
    worker_args: tuple[str, ...] = ("--max-sequence-length", str(text_tokens))
    worker_args += ("--device", args.device, "--dtype", args.dtype, "--threads-per-rank", "1")
    request = {**one_request(args.size, args.steps), **cfg_fields(family)}
    # Without CFG a cfg2 gang has no second branch: its CFG ranks split the tokens.
    plain = {**one_request(args.size, args.steps), **plain_fields(family)}
    plain_times: dict[str, list[float]] = {name: [] for name in PLAIN_LAYOUTS}
    times: dict[str, list[float]] = {name: [] for name in LAYOUTS}
    peak_mb: dict[str, float] = {}
    pngs: dict[str, bytes] = {}
    infos: dict[str, dict[str, Any]] = {}
    dropped = 0
    with ExitStack() as stack:
        workers, failed = start(stack, model, worker_args)
        clients = {
            name: stack.enter_context(w.client(timeout_s=900)) for name, w in workers.items()
        }
        for name, client in clients.items():
            infos[name] = client.control("model_info")
            client.generate(**request)  # first-request effects out of the timed rounds
            if name in PLAIN_LAYOUTS:
                client.generate(**plain)
        for round_no in range(args.rounds):
            for name, client in clients.items():
                wall, foreign, (result, blobs) = timed_round(
                    rank_processes(workers[name]), partial(client.generate, **request)
                )
                pngs[name] = blobs[0]
                peak_mb[name] = result.peak_memory_mb
                print(
                    f"round {round_no} {name} wall={wall:.3f} foreign={foreign:.2f}",
                    file=sys.stderr,
                )
                if foreign > args.max_foreign:
                    dropped += 1
                    continue
                times[name].append(wall)
            for name in (n for n in PLAIN_LAYOUTS if n in clients):
                wall, foreign, _ = timed_round(
                    rank_processes(workers[name]), partial(clients[name].generate, **plain)
                )
                if foreign > args.max_foreign:
                    dropped += 1
                    continue
                plain_times[name].append(wall)
    # The workers have stopped (and flushed their logs) before the figures are printed.
    medians = {name: median(values) for name, values in times.items()}
    speedups = {name: medians["single"] / medians[name] for name in PARALLEL}
    weights = weight_ratios(infos)
    ran = [n for n in LAYOUTS if n in infos]
    print(
        f"family={args.family} model={args.variant} size={args.size} steps={args.steps} "
        f"cfg={family.cfg}=4.0 "
        f"device={args.device} dtype={infos['single'].get('dtype')} threads_per_rank=1"
    )
    print("layouts: " + "; ".join(f"{n}: {infos[n].get('layout')}" for n in ran))
    for name, why in failed.items():
        print(f"layout {name} did not start ({why}); its figures print as nan")
    print("median s: " + " ".join(f"{n}={m:.3f} (n={len(times[n])})" for n, m in medians.items()))
    print(f"rounds: {args.rounds}; measurements dropped for a noisy neighbour: {dropped}")
    peaks = " ".join(f"{n}={peak_mb[n]:.0f}" for n in ran)
    print(f"peak_memory_mb (largest over the gang): {peaks}")
    if any(transformer_bytes(infos[n]) is None for n in ran):
        print(
            "per-rank weights: model_info has no rank_weights on every layout "
            "(a worker from before per-rank weight reports): unknown ratios print as nan"
        )
    print(
        "transformer bytes per rank vs one rank: "
        + " ".join(f"{n}={r:.2f}" for n, r in weights.items())
    )
    lent = median(plain_times["single"]) / median(plain_times["cfg2"])
    print(
        f"cfg2 without CFG ({infos.get('cfg2', {}).get('without_true_cfg')}): {lent:.2f} x one rank"
    )
    others = [n for n in PARALLEL if n in pngs]
    diffs = {n: pixel_difference(pngs["single"], pngs[n]) for n in others}
    same = [n for n in others if pngs[n] == pngs["single"]]
    print(
        "image max |diff| vs single (fraction of 255): "
        + " ".join(f"{n}={d:.4f}" for n, d in diffs.items())
        + f"; PNG bytes equal: {','.join(same) or 'none'}"
    )
    print(
        f"family={args.family} "
        + " ".join(f"{n}={speedups[n]:.2f}" for n in PARALLEL)
        + f" tp2_weights={weights['tp2']:.2f}"
    )
    if failed:
        sys.exit(1)


if __name__ == "__main__":
    main()
