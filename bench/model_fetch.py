"""Model sources, from the store to a loaded pipeline, in one run (issue 27). Sections:

``throughput``
    ``dpserve fetch``'s S3 path (plan, download, verify, publish) against boto3's own
    ``download_file`` of the same files from the same real S3 server (tests/storage), and
    against ``download_file`` followed by one MD5 pass (what checking the files by their
    ETags would add), rounds alternating so drift hits all alike. A synthetic pipeline:
    one component, ``--shards`` weight files of ``--shard-mb`` MB uploaded with boto3's
    default multipart transfer, so each is checked by its multipart ETag.
``replicas``
    ``dpserve serve --model s3://… --dp-size N`` (``--replicas``, default 4) with an empty
    ``--model-cache``, a counting forwarder (tests/storage/proxy.py) between it and the
    server (``AWS_ENDPOINT_URL`` is the forwarder's): the bytes the server sent once
    every replica serves, over the model's bytes (1.0: one fetch for all replicas),
    then one image.
``ready``
    Seconds from starting ``dpserve serve --dp-size 1`` to the first 200 of a small
    image request (64 px, 2 steps), for the model from ``s3://`` with an empty cache
    (cold), from ``s3://`` with that cache filled (warm, the same folder again) and from
    its local folder (baked: what a model in the image is). Rounds alternate the order.
``load``
    Loading the model folder in gangs of ranks forked from one process that imported
    torch and diffusers (tests/parallel_harness.py): ``tp1``, ``tp2`` (each rank reads
    only its pieces of the transformer: ``ModelParallel.read_transformer``) and
    ``tp2-whole`` (each rank loads the whole transformer and cuts it after, the path of a
    checkpoint that cannot be read piecewise). Each rank measures its load's peak
    resident set (``VmHWM``, reset through ``/proc/self/clear_refs`` just before) above
    what it held before, and its wall time. ``cat`` is ``cat FILES > /dev/null`` of the
    folder's files after one untimed read, so both read from the page cache (dropping it
    would need the whole machine).

The replicas, ready and load sections use a real pipeline (``--variant``, default
``small``: 273 MiB, of it a 269 MiB float32 transformer, so the fetch is measurable)
that the replicas load and serve. Everything is made in a temporary folder, removed at
the end. The last line holds every ratio: ``fetch_ratio`` and ``vs_checked_ratio``
(dpserve's time over boto3's, over boto3 then MD5), ``replicas<N>_bytes_ratio``,
``ready_cold_vs_baked``, ``ready_warm_vs_baked``, ``load_vs_cat`` (tp1's load time over
cat's), ``tp2_peak`` and ``tp2_whole_peak`` (the largest rank's load peak over tp1's).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import datetime
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


from bench.common import cached_model, one_request
from dpserve.sources.fetch import local_folder
from tests.parallel_harness import start_ranks
from tests.servers import ServeProcess
from tests.storage.proxy import CountingProxy
from tests.storage.s3 import S3Server, build_server, running_s3

MB = 1 << 20
SECTIONS = ("throughput", "replicas", "ready", "load")
INDEX = {"_class_name": "FluxPipeline", "transformer": ["diffusers", "FluxTransformer2DModel"]}
LAYOUTS: dict[str, tuple[dict[str, int], bool]] = {
    "tp1": ({}, True),
    "tp2": ({"tp": 2}, True),
    "tp2-whole": ({"tp": 2}, False),
}
BUCKET = "bench"
MODEL_PREFIX = "model"  # the real pipeline, for the replicas and ready sections


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--sections", default=",".join(SECTIONS), help="comma-separated")
    parser.add_argument("--quick", action="store_true", help="rounds: 2 throughput, 1 ready")
    parser.add_argument("--shards", type=int, default=4)
    parser.add_argument("--shard-mb", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=3, help="throughput rounds")
    parser.add_argument("--ready-rounds", type=int, default=2)
    parser.add_argument("--replicas", type=int, default=4)
    parser.add_argument("--model", type=Path, help="a model folder (default: --variant's)")
    parser.add_argument("--variant", default="small", choices=("tiny", "small", "large"))
    args = parser.parse_args()
    if args.quick:
        args.rounds, args.ready_rounds = 2, 1
    sections = args.sections.split(",")
    if unknown := set(sections) - set(SECTIONS):
        parser.error(f"unknown sections {sorted(unknown)}; known: {', '.join(SECTIONS)}")

    model = args.model or cached_model(args.variant)
    files = _files(model)
    print(f"model={model} files={len(files)} size={_size(files) / MB:.0f}MB", flush=True)
    figures: dict[str, float] = {}
    work = Path(tempfile.mkdtemp(prefix="dpserve-bench-fetch-"))
    try:
        if {"throughput", "replicas", "ready"} & set(sections):
            with running_s3(build_server(), parent=work) as server:
                os.environ.update(server.env())
                s3 = server.client()
                s3.create_bucket(Bucket=BUCKET)
                if "throughput" in sections:
                    figures |= throughput(s3, work, args.shards, args.shard_mb, args.rounds)
                source = f"s3://{BUCKET}/{MODEL_PREFIX}/"
                if {"replicas", "ready"} & set(sections):
                    _upload_folder(s3, model, MODEL_PREFIX)
                if "replicas" in sections:
                    figures |= replicas(server, source, _size(files), args.replicas, work)
                if "ready" in sections:
                    figures |= time_to_ready(source, model, args.ready_rounds, work)
        if "load" in sections:
            figures |= loading(model, files)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(" ".join(f"{name}={value:.2f}" for name, value in figures.items()), flush=True)


# Shared helpers


def _files(folder: Path) -> list[Path]:
    return sorted(p for p in folder.rglob("*") if p.is_file())


def _size(files: list[Path]) -> int:
    return sum(p.stat().st_size for p in files)


def _upload_folder(s3: Any, folder: Path, prefix: str) -> list[str]:
    """Every file of ``folder`` under ``prefix`` with boto3's default transfer (multipart
    above 8 MB, so a large weight file is checked by its multipart ETag); the keys
    relative to ``prefix``."""
    keys = [str(p.relative_to(folder)) for p in _files(folder)]
    for key in keys:
        s3.upload_file(str(folder / key), BUCKET, f"{prefix}/{key}")
    return keys


def _tail(log: Path, chars: int = 3000) -> str:
    return log.read_text(errors="replace")[-chars:] if log.is_file() else "(no log)"


@contextmanager
def _serving(model: str | Path, dp_size: int, log: Path, *flags: str) -> Iterator[ServeProcess]:
    """``dpserve serve`` on the CPU, its output in ``log``, until /health answers."""
    try:
        serve = ServeProcess(model, dp_size, "--device", "cpu", *flags, timeout_s=600, log=log)
    except (RuntimeError, TimeoutError) as failed:
        raise RuntimeError(f"{failed}; the log ends:\n{_tail(log)}") from failed
    with serve:
        yield serve


def _first_image(serve: ServeProcess, timeout_s: float = 600) -> None:
    """Until the router answers a small image request with 200 (503 while no replica
    serves yet)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        reply = serve.http.post("/v1/images/generations", json=one_request(64, 2))
        if reply.status_code == 200:
            return
        if reply.status_code != 503:
            raise RuntimeError(f"image request answered {reply.status_code}: {reply.text}")
        time.sleep(0.1)
    raise TimeoutError(f"{serve.url} answered no image in {timeout_s:.0f}s")


def _wait_serving(serve: ServeProcess, replicas: int, timeout_s: float = 600) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if serve.http.get("/ready").json().get("serving", 0) >= replicas:
            return
        time.sleep(0.2)
    raise TimeoutError(f"{serve.url}: fewer than {replicas} replicas serving in {timeout_s:.0f}s")


@contextmanager
def _endpoint(url: str) -> Iterator[None]:
    """``AWS_ENDPOINT_URL`` set to ``url`` for this process and its children meanwhile."""
    before = os.environ["AWS_ENDPOINT_URL"]
    os.environ["AWS_ENDPOINT_URL"] = url
    try:
        yield
    finally:
        os.environ["AWS_ENDPOINT_URL"] = before


# throughput


def throughput(s3: Any, work: Path, shards: int, shard_mb: int, rounds: int) -> dict[str, float]:
    src = work / "synthetic"
    keys = _synthetic(s3, src, shards, shard_mb)
    total = _size([src / k for k in keys])
    times: dict[str, list[float]] = {"ours": [], "theirs": [], "checked": []}
    for r in range(rounds):
        order = list(times) if r % 2 == 0 else list(reversed(times))
        for who in order:
            out = work / f"{who}-{r}"
            began = time.perf_counter()
            if who == "ours":
                local_folder(f"s3://{BUCKET}/m", out, say=lambda _: None, bar=False)
            else:
                for key in keys:
                    (out / key).parent.mkdir(parents=True, exist_ok=True)
                    s3.download_file(BUCKET, f"m/{key}", str(out / key))
                    if who == "checked":  # and one MD5 pass, as a plain check would
                        hashlib.md5((out / key).read_bytes())
            times[who].append(time.perf_counter() - began)
            shutil.rmtree(out)
    shutil.rmtree(src)
    ours, theirs, checked = (statistics.median(times[who]) for who in times)
    mb = total / 1e6
    print(f"throughput: {len(keys)} files, {mb:.0f} MB; seconds per round: {times}")
    print(f"throughput: dpserve {mb / ours:.0f} MB/s, boto3 download_file {mb / theirs:.0f} MB/s")
    return {"fetch_ratio": ours / theirs, "vs_checked_ratio": ours / checked}


def _synthetic(s3: Any, src: Path, shards: int, shard_mb: int) -> list[str]:
    folder = src / "transformer"
    folder.mkdir(parents=True)
    (src / "model_index.json").write_text(json.dumps(INDEX))
    (folder / "config.json").write_text("{}")
    for i in range(1, shards + 1):
        name = f"diffusion_pytorch_model-{i:05d}-of-{shards:05d}.safetensors"
        (folder / name).write_bytes(os.urandom(shard_mb * MB))
    index: dict[str, dict[str, str]] = {"weight_map": {}, "metadata": {}}
    (folder / "diffusion_pytorch_model.safetensors.index.json").write_text(json.dumps(index))
    return _upload_folder(s3, src, "m")


# replicas


def replicas(server: S3Server, source: str, size: int, count: int, work: Path) -> dict[str, float]:
    cache, log = work / "replicas-cache", work / "replicas.log"
    began = time.perf_counter()
    flags = ("--model-cache", str(cache))
    with (
        CountingProxy(server.endpoint_url) as proxy,
        _endpoint(proxy.url),
        _serving(source, count, log, *flags) as serve,
    ):
        _wait_serving(serve, count)
        sent = proxy.sent
        _first_image(serve)
    seconds = time.perf_counter() - began
    print(
        f"replicas: {count} serving after {seconds:.1f}s; the store sent {sent} bytes "
        f"for a {size}-byte model"
    )
    return {f"replicas{count}_bytes_ratio": sent / size}


# time to ready


def time_to_ready(source: str, model: Path, rounds: int, work: Path) -> dict[str, float]:
    times: dict[str, list[float]] = {"baked": [], "cold": [], "warm": []}
    for r in range(rounds):
        cache = work / f"ready-cache-{r}"
        # warm reuses cold's cache, so it always follows cold
        order = ["baked", "cold", "warm"] if r % 2 == 0 else ["cold", "warm", "baked"]
        for how in order:
            flags = [] if how == "baked" else ["--model-cache", str(cache)]
            log = work / f"ready-{how}-{r}.log"
            seconds = _seconds_to_image(model if how == "baked" else source, flags, log)
            times[how].append(seconds)
            print(f"ready: {how} round {r}: {seconds:.1f}s; {_startup(log)}", flush=True)
    baked, cold, warm = (statistics.median(times[how]) for how in times)
    return {"ready_cold_vs_baked": cold / baked, "ready_warm_vs_baked": warm / baked}


def _seconds_to_image(model: str | Path, flags: list[str], log: Path) -> float:
    began = time.perf_counter()
    with _serving(model, 1, log, *flags) as serve:
        _first_image(serve)
        return time.perf_counter() - began


def _startup(log: Path) -> str:
    """Where a serve's start-up went, from its log: the fetch (from the plan to the
    replicas' start) and the replica's own account (imports, load, warm-up)."""
    text = log.read_text(errors="replace")
    stamps = {
        what: datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S,%f")
        for what, pattern in (("plan", r"plan: s3://"), ("start", r"dpserve\.serve starting"))
        if (m := re.search(r"^(\S+ \S+) .*" + pattern, text, re.MULTILINE))
    }
    fetch = (
        f"fetch {(stamps['start'] - stamps['plan']).total_seconds():.1f}s, "
        if len(stamps) == 2
        else ""
    )
    replica = re.search(r"start-up [\d.]+s: [^\n]*", text)
    return fetch + (replica.group(0) if replica else "no start-up line")


# load


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


def loading(model: Path, files: list[Path]) -> dict[str, float]:
    size_mb = _size(files) / MB
    cat = cat_seconds(files)
    results = {name: gang_load(model, *how) for name, how in LAYOUTS.items()}
    for name, ranks in results.items():
        for r, facts in enumerate(ranks):
            share = facts["read_share"]
            print(
                f"load: {name} rank {r}: peak={facts['peak_mb']:.0f}MB "
                f"held after={facts['held_mb']:.0f}MB transformer={facts['transformer_mb']:.0f}MB "
                f"load={facts['seconds']:.2f}s read_share="
                + ("whole" if share is None else f"{share:.2f}")
            )
    one = results["tp1"][0]
    print(f"load: cat of the same files (page cache warm) {cat:.2f}s ({size_mb / cat:.0f} MB/s)")
    print(f"load: tp1 {one['seconds']:.2f}s ({size_mb / one['seconds']:.0f} MB/s)")

    def peak(name: str) -> float:
        return max(f["peak_mb"] for f in results[name]) / one["peak_mb"]

    return {
        "load_vs_cat": one["seconds"] / cat,
        "tp2_peak": peak("tp2"),
        "tp2_whole_peak": peak("tp2-whole"),
    }


if __name__ == "__main__":
    main()
