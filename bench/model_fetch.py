"""Fetch throughput: ``dpserve fetch``'s S3 path (plan, download, verify, publish)
against boto3's own ``download_file`` of the same files from the same real S3 server
(and against ``download_file`` followed by one MD5 pass, what checking the files by
their ETags would add), in the same run, rounds alternating so drift hits all alike.

A synthetic pipeline (one component, ``--shards`` weight files of ``--shard-mb`` MB,
uploaded with boto3's default multipart transfer, so each is checked by its
multipart ETag) on the test S3 server (tests/storage). Everything is removed at the
end. Last line: ``fetch_ratio=<dpserve / boto3 time> vs_checked_ratio=<dpserve / boto3 then
MD5 time> dpserve_MBps=… boto3_MBps=…``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from dpserve.sources.fetch import local_folder
from tests.storage.s3 import build_server, running_s3

INDEX = {"_class_name": "FluxPipeline", "transformer": ["diffusers", "FluxTransformer2DModel"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--shards", type=int, default=4)
    parser.add_argument("--shard-mb", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="dpserve-bench-fetch-"))
    try:
        with running_s3(build_server(), parent=work) as server:
            os.environ.update(server.env())
            s3 = server.client()
            s3.create_bucket(Bucket="bench")
            keys = _upload(s3, work / "src", args.shards, args.shard_mb)
            total = sum((work / "src" / k).stat().st_size for k in keys)
            times: dict[str, list[float]] = {"ours": [], "theirs": [], "checked": []}
            for r in range(args.rounds):
                order = list(times) if r % 2 == 0 else list(reversed(times))
                for who in order:
                    out = work / f"{who}-{r}"
                    began = time.perf_counter()
                    if who == "ours":
                        local_folder("s3://bench/m", out, say=lambda _: None, bar=False)
                    else:
                        for key in keys:
                            (out / key).parent.mkdir(parents=True, exist_ok=True)
                            s3.download_file("bench", f"m/{key}", str(out / key))
                            if who == "checked":  # and one MD5 pass, as a plain check would
                                hashlib.md5((out / key).read_bytes())
                    times[who].append(time.perf_counter() - began)
                    shutil.rmtree(out)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    a, b, c = (statistics.median(times[who]) for who in ("ours", "theirs", "checked"))
    mb = total / 1e6
    print(f"{len(keys)} files, {mb:.0f} MB; seconds per round: {times}")
    print(
        f"fetch_ratio={a / b:.2f} vs_checked_ratio={a / c:.2f} dpserve_MBps={mb / a:.0f} "
        f"boto3_MBps={mb / b:.0f}"
    )


def _upload(s3: object, src: Path, shards: int, shard_mb: int) -> list[str]:
    folder = src / "transformer"
    folder.mkdir(parents=True)
    (src / "model_index.json").write_text(json.dumps(INDEX))
    (folder / "config.json").write_text("{}")
    names = [
        f"diffusion_pytorch_model-{i:05d}-of-{shards:05d}.safetensors" for i in range(1, shards + 1)
    ]
    for name in names:
        (folder / name).write_bytes(os.urandom(shard_mb << 20))
    index = {"weight_map": {}, "metadata": {}}
    (folder / "diffusion_pytorch_model.safetensors.index.json").write_text(json.dumps(index))
    keys = sorted(str(p.relative_to(src)) for p in src.rglob("*") if p.is_file())
    for key in keys:
        s3.upload_file(str(src / key), "bench", f"m/{key}")  # type: ignore[attr-defined]
    return keys


if __name__ == "__main__":
    main()
