"""The image API's costs, side by side in one run: previews, cancellation, n, encoding.

One ``dpserve serve --dp-size 1`` of the ``small`` model, over real HTTP:

- ``first_preview_frac``: time to the first partial image over time to the full
  image, streaming with ``partial_images=2`` (previews after 1/3 and 2/3 of the
  steps, so about 0.33 plus the preview's own decode is the ideal);
- ``cancel_steps``: a long request is cancelled by id once its first preview shows
  it running, and a second request waits behind it; denoising steps (of the long
  request's own step time) from the cancel call to the replica starting the second;
- ``n4_vs_4x1``: four sequential one-image requests over one ``n=4`` request (>1:
  the batched call is cheaper); each batched image is compared with the same seed
  alone (PSNR in dB; ``inf`` means identical bytes after decoding);
- encode time per format at 512x512 as the replica reports it (``encode_time_s``).

Last line: ``first_preview_frac=<x> cancel_steps=<y> n4_vs_4x1=<z> webp_encode_ms=<w>``.
"""

from __future__ import annotations

import argparse
import base64
import io
import json
import math
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
from PIL import Image

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import cached_model, wait_ready
from dpserve.plumbing.ports import free_port

ROUTE = "/v1/images/generations"


class Serve:
    def __init__(self, model: Path, threads: int) -> None:
        port = free_port()
        self.url = f"http://127.0.0.1:{port}"
        cmd = [sys.executable, "-m", "dpserve", "serve", "--model", str(model)]
        cmd += ["--port", str(port), "--dp-size", "1", "--scheduler-port", str(free_port())]
        cmd += ["--threads-per-rank", str(threads), "--max-sequence-length", "77"]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        wait_ready(self.url, 300, self.proc)
        self.http = httpx.Client(base_url=self.url, timeout=600)

    def post(self, body: dict[str, Any], **headers: str) -> dict[str, Any]:
        response = self.http.post(ROUTE, json=body, headers=headers)
        response.raise_for_status()
        result: dict[str, Any] = response.json()
        return result

    def events(
        self, body: dict[str, Any], request_id: str
    ) -> Iterator[tuple[float, dict[str, Any]]]:
        """The stream's events as they arrive, each with its arrival time."""
        headers = {"X-Request-Id": request_id}
        with self.http.stream("POST", ROUTE, json={**body, "stream": True}, headers=headers) as r:
            r.raise_for_status()
            for line in r.iter_lines():
                if line.startswith("data:"):
                    yield time.perf_counter(), json.loads(line[5:])

    def close(self) -> None:
        self.proc.terminate()
        self.proc.wait(timeout=120)


def _decode(b64: str) -> np.ndarray:
    with Image.open(io.BytesIO(base64.b64decode(b64))) as img:
        return np.asarray(img.convert("RGB"), dtype=np.float64)


def psnr(a: np.ndarray, b: np.ndarray) -> float:
    mse = float(np.mean((a - b) ** 2))
    return math.inf if mse == 0 else 10 * math.log10(255.0**2 / mse)


def first_preview(serve: Serve, body: dict[str, Any], rounds: int) -> float:
    fracs = []
    for i in range(rounds):
        start = time.perf_counter()
        first = done = None
        for at, event in serve.events({**body, "partial_images": 2}, f"bench-preview-{i}"):
            if event.get("type", "").endswith("partial_image") and first is None:
                first = at - start
            elif event.get("type", "").endswith("completed"):
                done = at - start
        assert first is not None and done is not None, "the stream lacked a preview or the image"
        fracs.append(first / done)
    return statistics.median(fracs)


def cancel_steps(serve: Serve, body: dict[str, Any], steps: int, rounds: int) -> float:
    """Steps from the cancel call to the replica starting the request queued behind."""
    long_body = {**body, "num_inference_steps": steps, "partial_images": 3}
    plain = serve.post({**body, "num_inference_steps": steps})
    step_s = plain["inference_time_s"] / steps
    counts = []
    for i in range(rounds):
        rid = f"bench-cancel-{i}"
        started = threading.Event()
        ended: list[dict[str, Any]] = []

        def stream() -> None:
            for _, event in serve.events(long_body, rid):  # noqa: B023
                if event.get("type", "").endswith("partial_image"):
                    started.set()  # noqa: B023
                ended.append(event)  # noqa: B023

        reader = threading.Thread(target=stream)
        reader.start()
        assert started.wait(300), "the long request never showed a preview"
        behind: dict[str, Any] = {}

        def queued() -> None:
            submitted = time.perf_counter()
            behind.update(serve.post({**body, "num_inference_steps": 2}))  # noqa: B023
            behind["submitted"] = submitted  # noqa: B023

        waiter = threading.Thread(target=queued)
        waiter.start()
        time.sleep(0.2)  # the second request is queued at the replica behind the long one
        cancelled_at = time.perf_counter()
        answer = serve.http.post(f"/v1/images/{rid}/cancel")
        assert answer.status_code == 200, answer.text
        waiter.join()
        reader.join()
        assert ended and "error" in ended[-1], "the cancelled stream did not end in an error"
        next_started = behind["submitted"] + behind["queue_time_s"]
        counts.append(max(0.0, next_started - cancelled_at) / step_s)
    return statistics.median(counts)


def batch_vs_sequential(serve: Serve, body: dict[str, Any], rounds: int) -> tuple[float, float]:
    ratios, worst = [], math.inf
    for _ in range(rounds):
        start = time.perf_counter()
        batched = serve.post({**body, "n": 4, "seed": 100})
        one_call = time.perf_counter() - start
        start = time.perf_counter()
        alone = [serve.post({**body, "seed": 100 + i}) for i in range(4)]
        four_calls = time.perf_counter() - start
        ratios.append(four_calls / one_call)
        for i, single in enumerate(alone):
            a, b = _decode(batched["data"][i]["b64_json"]), _decode(single["data"][0]["b64_json"])
            worst = min(worst, psnr(a, b))
    return statistics.median(ratios), worst


def encode_ms(serve: Serve, body: dict[str, Any]) -> dict[str, float]:
    shapes = {
        "png": {"output_format": "png"},
        "jpeg": {"output_format": "jpeg"},
        "jpeg_q80": {"output_format": "jpeg", "output_compression": 80},
        "webp": {"output_format": "webp"},
        "webp_q80": {"output_format": "webp", "output_compression": 80},
    }
    out = {}
    for name, extra in shapes.items():
        times = [serve.post({**body, **extra})["encode_time_s"] for _ in range(3)]
        out[name] = 1000 * statistics.median(times)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--variant", default="small", choices=("tiny", "small"))
    parser.add_argument("--size", type=int, default=128)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--cancel-steps", type=int, default=60, help="the long request's steps")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    model = cached_model(args.variant)
    body = {
        "prompt": "a harbour at dawn",
        "size": f"{args.size}x{args.size}",
        "num_inference_steps": args.steps,
        "seed": 7,
    }
    serve = Serve(model, args.threads)
    try:
        serve.post(body)  # warm
        frac = first_preview(serve, body, args.rounds)
        print(f"preview: first partial at {frac:.2f} of the full image's time", flush=True)
        steps = cancel_steps(serve, body, args.cancel_steps, args.rounds)
        print(f"cancel: the next request started {steps:.2f} steps after the cancel", flush=True)
        n4, worst = batch_vs_sequential(serve, body, args.rounds)
        print(f"n=4: 4 x n=1 takes {n4:.2f}x one n=4 call; batched vs alone PSNR >= {worst:.1f} dB")
        big = {**body, "size": "512x512", "num_inference_steps": 1}
        enc = encode_ms(serve, big)
        print("encode ms at 512x512: " + " ".join(f"{k}={v:.1f}" for k, v in enc.items()))
    finally:
        serve.close()
    print(
        f"first_preview_frac={frac:.3f} cancel_steps={steps:.2f} n4_vs_4x1={n4:.2f} "
        f"webp_encode_ms={enc['webp']:.1f}"
    )


if __name__ == "__main__":
    main()
