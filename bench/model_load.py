"""Loading a model from its cache folder: host peak memory per rank, tp2 against tp1, and
load time against reading the same files once.

One run starts three gangs of the same model folder one after another, each rank a
process forked from one that imported torch and diffusers (tests/parallel_harness.py):
``tp1`` (one rank), ``tp2`` (two ranks, each reading only its pieces of the
transformer's checkpoint: ``ModelParallel.read_transformer``) and ``tp2-whole`` (two
ranks that load the whole transformer and cut it after, the path a checkpoint that
cannot be read piecewise takes). Each rank measures its own load: the peak resident
set (``VmHWM``, reset just before the load through ``/proc/self/clear_refs``) above
what it held before, so the imports every rank shares do not count, and the load's
wall time. ``cat`` is ``cat FILES > /dev/null`` of the files the load reads (every
file of the folder), timed after one untimed read, so both read from the page cache
(dropping it would need the whole machine).

Last line: ``tp2_peak=<r> tp2_whole_peak=<w> load_vs_cat=<x>``: the largest tp2 rank's
load peak over tp1's, the same for ``tp2-whole``, and tp1's load time over ``cat``'s.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.common import cached_model
from tests.parallel_harness import start_ranks

MB = 1 << 20
LAYOUTS: dict[str, tuple[dict[str, int], bool]] = {
    "tp1": ({}, True),
    "tp2": ({"tp": 2}, True),
    "tp2-whole": ({"tp": 2}, False),
}


def _status_kb(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")


def _rank(rank: int, model: str, layout: dict[str, int], read: bool, store: str, out: str) -> None:
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    import torch
    import torch.distributed as dist

    from dpserve.contract.layout import ParallelConfig
    from dpserve.worker.comm import init_gang
    from dpserve.worker.parallel import ModelParallel
    from dpserve.worker.pipeline import load_pipeline

    torch.set_num_threads(1)
    config = ParallelConfig(**layout)
    comm = init_gang(config, rank, store, torch.device("cpu"), 120.0)
    parallel = ModelParallel(comm.info, comm.model_groups, config)
    reader = parallel.read_transformer if read else (lambda folder, cls, dtype: None)
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
    before = _status_kb("VmRSS")
    started = time.perf_counter()
    pipe = load_pipeline(
        Path(model), torch.device("cpu"), torch.float32, parallel.prepare, None, reader
    )
    seconds = time.perf_counter() - started
    peak, after = _status_kb("VmHWM"), _status_kb("VmRSS")
    held = sum(p.numel() * p.element_size() for p in pipe.transformer.parameters())
    report = parallel.read_report
    facts = {
        "peak_mb": (peak - before) / 1024,
        "held_mb": (after - before) / 1024,
        "transformer_mb": held / MB,
        "seconds": seconds,
        "read_share": None if report is None else report.share,
    }
    Path(out, f"rank-{rank}.json").write_text(json.dumps(facts))
    dist.destroy_process_group()


def gang_load(model: Path, layout: dict[str, int], read: bool) -> list[dict[str, Any]]:
    size = max(1, layout.get("tp", 1))
    with tempfile.TemporaryDirectory(prefix="dpserve-load-") as tmp:
        start_ranks(_rank, (str(model), layout, read, os.path.join(tmp, "store"), tmp), size)
        return [json.loads(Path(tmp, f"rank-{r}.json").read_text()) for r in range(size)]


def cat_seconds(files: list[Path]) -> float:
    subprocess.run(["cat", *map(str, files)], stdout=subprocess.DEVNULL, check=True)
    started = time.perf_counter()
    subprocess.run(["cat", *map(str, files)], stdout=subprocess.DEVNULL, check=True)
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", type=Path, help="a model folder (default: --variant's)")
    parser.add_argument("--variant", default="small", choices=("tiny", "small", "large"))
    args = parser.parse_args()

    model = args.model or cached_model(args.variant)
    files = sorted(p for p in model.rglob("*") if p.is_file())
    size_mb = sum(p.stat().st_size for p in files) / MB
    transformer_mb = sum(p.stat().st_size for p in (model / "transformer").glob("*")) / MB
    cat = cat_seconds(files)
    results = {name: gang_load(model, *how) for name, how in LAYOUTS.items()}
    print(
        f"model={model} files={len(files)} size={size_mb:.0f}MB transformer={transformer_mb:.0f}MB"
    )
    for name, ranks in results.items():
        for r, facts in enumerate(ranks):
            share = facts["read_share"]
            print(
                f"{name} rank {r}: load peak={facts['peak_mb']:.0f}MB "
                f"held after={facts['held_mb']:.0f}MB transformer={facts['transformer_mb']:.0f}MB "
                f"load={facts['seconds']:.2f}s read_share="
                + ("whole" if share is None else f"{share:.2f}")
            )
    one = results["tp1"][0]
    print(f"cat of the same files (page cache warm): {cat:.2f}s ({size_mb / cat:.0f} MB/s)")
    print(f"tp1 load: {one['seconds']:.2f}s ({size_mb / one['seconds']:.0f} MB/s)")

    def ratio(name: str) -> float:
        return max(f["peak_mb"] for f in results[name]) / one["peak_mb"]

    print(
        f"tp2_peak={ratio('tp2'):.2f} tp2_whole_peak={ratio('tp2-whole'):.2f} "
        f"load_vs_cat={one['seconds'] / cat:.1f}"
    )
    sys.stdout.flush()


if __name__ == "__main__":
    main()
