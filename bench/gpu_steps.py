"""The Python half of ``bench/gpu.sh``: wheel list, offline fallback install, serving checks.

Imports only the standard library at the top: ``roots`` and ``extract`` run on
the GPU machine before anything is installed there.

- ``roots``: the requirements the GPU machine must satisfy (one a line).
- ``pins``: those requirements and everything they need, pinned to the versions
  installed in this interpreter, less what the GPU machine brings (torch and its
  CUDA packages): the list ``gpu.sh prepare`` downloads.
- ``missing WHEELS``: the wheels whose distribution this interpreter lacks.
- ``extract WHEELS TARGET``: unpack every wheel whose distribution this
  interpreter lacks into TARGET (for PYTHONPATH): the install of last resort
  when neither a virtual environment nor pip can be had.
- ``serve-checks``: one rank's latency, same-seed determinism, and two replicas
  sharing one device (a concurrent pair vs one request); JSON files in ``--out``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import re
import statistics
import sys
import threading
import time
import zipfile
from importlib import metadata
from pathlib import Path
from typing import Any

# What dpserve's worker, the benchmarks and the test runner import, with the bounds
# pyproject.toml gives them: its dependencies, the worker extra (torch comes with the
# machine), and from the other extras what a GPU check runs (the test runner, httpx;
# FastAPI, uvicorn and pydantic so `dpserve serve` can run there too).
_PICKED = {
    "worker": None,  # all of it
    "dev": ("pytest", "pytest-timeout", "httpx"),
    "router": ("fastapi", "uvicorn"),
    "operator": ("pydantic",),
}


def roots() -> list[str]:
    import tomllib

    project = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())["project"]
    found = list(project["dependencies"])
    for extra, names in _PICKED.items():
        for spec in project["optional-dependencies"][extra]:
            name = re.split(r"[\[<>=!~ ]", spec, maxsplit=1)[0]
            if names is None or name in names:
                found.append(re.sub(r"\[.*?\]", "", spec))  # no extras: no wheels for them
    return [spec for spec in found if not _BROUGHT_BY_MACHINE.match(re.split(r"[<>=!~ ]", spec)[0])]


# On the GPU machine already, never downloaded: torch and its CUDA packages (gigabytes),
# and numpy (16 MB of the 64 the device tool carries), which its transformers needs.
# Not downloaded either: what no GPU check loads (video encoding, S3 sources), 55 MB
# together, which the device tool's 64 MB could not carry beside the rest.
_BROUGHT_BY_MACHINE = re.compile(
    r"^(torch|triton|nvidia-.*|cuda-.*|numpy|av|boto3|botocore|s3transfer|jmespath)$"
)


def _canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def pins(python_version: str) -> list[str]:
    """``name==version`` for the roots and their dependencies as installed here, with
    environment markers evaluated for CPython ``python_version`` on Linux x86-64."""
    from packaging.requirements import Requirement

    env = {
        "python_version": python_version,
        "python_full_version": f"{python_version}.0",
        "sys_platform": "linux",
        "platform_system": "Linux",
        "platform_machine": "x86_64",
        "os_name": "posix",
        "implementation_name": "cpython",
        "platform_python_implementation": "CPython",
        "extra": "",
    }
    found: dict[str, str] = {}
    todo = [Requirement(r).name for r in roots()]
    while todo:
        name = _canonical(todo.pop())
        if name in found or _BROUGHT_BY_MACHINE.match(name):
            continue
        try:
            dist = metadata.distribution(name)
        except metadata.PackageNotFoundError:
            raise SystemExit(f"{name} is needed but not installed here: install it") from None
        found[name] = dist.version
        for line in dist.requires or []:
            req = Requirement(line)
            if req.marker is None or req.marker.evaluate(env):
                todo.append(req.name)
    return [f"{name}=={version}" for name, version in sorted(found.items())]


def _wheel_dist(path: Path) -> str:
    return _canonical(path.name.split("-", 1)[0])


def missing(wheels: Path) -> list[Path]:
    """The wheels in ``wheels`` whose distribution this interpreter does not have at all."""
    have = {_canonical(d.metadata["Name"]) for d in metadata.distributions()}
    return [w for w in sorted(wheels.glob("*.whl")) if _wheel_dist(w) not in have]


def extract(wheels: Path, target: Path) -> list[str]:
    """Unpack the wheels of distributions this interpreter lacks into ``target``."""
    target.mkdir(parents=True, exist_ok=True)
    done = []
    for wheel in missing(wheels):
        with zipfile.ZipFile(wheel) as zf:
            zf.extractall(target)
        done.append(wheel.name)
    return done


# --------------------------------------------------------------------------- serving checks


def _write(out: Path, name: str, data: dict[str, Any]) -> None:
    (out / name).write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")


def serve_checks(args: argparse.Namespace) -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from bench.common import one_request
    from dpserve.local import WorkerProcess

    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    flags: tuple[str, ...] = ("--device", args.device, "--dtype", args.dtype, "--first-gpu", "0")
    if args.max_sequence_length:
        flags += ("--max-sequence-length", str(args.max_sequence_length))
    request = one_request(args.size, args.steps)
    started = time.perf_counter()
    # Both replicas on device 0 (--first-gpu 0): dp=2 sharing one GPU. Started together.
    with (
        WorkerProcess(args.model, *flags, wait=False) as a,
        WorkerProcess(args.model, *flags, "--replica", "1", wait=False) as b,
    ):
        a.wait_ready(args.ready_timeout)
        b.wait_ready(args.ready_timeout)
        ready_s = time.perf_counter() - started
        with a.client(timeout_s=300) as ca, b.client(timeout_s=300) as cb:
            info = ca.control("model_info")
            _, first_a = ca.generate(**request)  # first request at this size: kernels, autotune
            _, first_b = cb.generate(**request)

            walls, inference, peaks, digests = [], [], [], []
            for _ in range(args.repeats):
                t0 = time.perf_counter()
                result, blobs = ca.generate(**request)
                walls.append(time.perf_counter() - t0)
                inference.append(result.inference_time_s)
                peaks.append(result.peak_memory_mb)
                digests.append(_sha(blobs[0]))
            single = {
                "size": args.size,
                "steps": args.steps,
                "device": info.get("device"),
                "dtype": info.get("dtype"),
                "max_sequence_length": info.get("max_sequence_length"),
                "ready_s": round(ready_s, 2),
                "wall_s": walls,
                "median_wall_s": statistics.median(walls),
                "median_inference_s": statistics.median(inference),
                "peak_memory_mb": max(peaks),
                "png_sha256": digests,
                "same_bytes_same_process": len({*digests, _sha(first_a[0])}) == 1,
                "same_bytes_two_processes": first_a[0] == first_b[0],
            }
            _write(out, "single.json", single)
            print(
                f"single: {args.size}x{args.size} {args.steps} steps {single['dtype']} on "
                f"{single['device']}: median {single['median_wall_s']:.3f} s "
                f"(inference {single['median_inference_s']:.3f} s), "
                f"peak {single['peak_memory_mb']:.0f} MB"
            )
            print(
                f"determinism (seed 1234): same PNG bytes in one process "
                f"{str(single['same_bytes_same_process']).lower()}, across two processes "
                f"{str(single['same_bytes_two_processes']).lower()}"
            )

            ones, pairs = [], []
            for _ in range(args.pair_rounds):
                t0 = time.perf_counter()
                ca.generate(**request)
                ones.append(time.perf_counter() - t0)
                errors: list[BaseException] = []

                def call(client: Any, errors: list[BaseException] = errors) -> None:
                    try:
                        client.generate(**request)
                    except BaseException as exc:
                        errors.append(exc)

                threads = [threading.Thread(target=call, args=(c,)) for c in (ca, cb)]
                t0 = time.perf_counter()
                for t in threads:
                    t.start()
                for t in threads:
                    t.join()
                pairs.append(time.perf_counter() - t0)
                if errors:
                    raise errors[0]
            ratios = [p / o for p, o in zip(pairs, ones, strict=True)]
            pair = {
                "one_s": ones,
                "pair_s": pairs,
                "pair_ratio": statistics.median(ratios),
                "note": "two replicas on one device; 1: the pair overlaps fully, 2: it serializes",
            }
            _write(out, "dp_pair.json", pair)
            print(
                f"dp=2 on one device: pair_ratio={pair['pair_ratio']:.2f} "
                f"(pair {statistics.median(pairs):.3f} s vs one {statistics.median(ones):.3f} s)"
            )


def _sha(blob: bytes) -> str:
    return hashlib.sha256(blob).hexdigest()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("roots")
    p = sub.add_parser("pins")
    p.add_argument("--python-version", default="3.12")
    m = sub.add_parser("missing")
    m.add_argument("wheels", type=Path)
    e = sub.add_parser("extract")
    e.add_argument("wheels", type=Path)
    e.add_argument("target", type=Path)
    s = sub.add_parser("serve-checks")
    s.add_argument("--model", type=Path, required=True)
    s.add_argument("--out", type=Path, required=True)
    s.add_argument("--device", default="cuda")
    s.add_argument("--dtype", default="bfloat16")
    s.add_argument("--size", type=int, default=1024)
    s.add_argument("--steps", type=int, default=4)
    s.add_argument("--max-sequence-length", type=int, default=None)
    s.add_argument("--repeats", type=int, default=3)
    s.add_argument("--pair-rounds", type=int, default=3)
    s.add_argument("--ready-timeout", type=float, default=240.0)
    args = parser.parse_args()
    if args.command == "roots":
        print("\n".join(roots()))
    elif args.command == "pins":
        print("\n".join(pins(args.python_version)))
    elif args.command == "missing":
        print("\n".join(str(w) for w in missing(args.wheels)))
    elif args.command == "extract":
        for name in extract(args.wheels, args.target):
            print(f"extracted {name}")
    else:
        serve_checks(args)


if __name__ == "__main__":
    main()
