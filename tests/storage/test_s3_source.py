"""``s3://`` model sources against a real S3 server: the plan, the store's digests, a
corrupt object, a killed fetch that resumes, two fetches that download once, and
``dpserve serve --model s3://…`` answering an image (dpserve/sources/s3.py)."""

from __future__ import annotations

import base64
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from dpserve.sources.errors import DigestMismatch, SourceError
from dpserve.sources.fetch import local_folder
from tests.polling import eventually
from tests.servers import ServeProcess
from tests.storage.proxy import CountingProxy
from tests.storage.s3 import S3Server, upload_folder

pytestmark = [pytest.mark.e2e, pytest.mark.s3]

MiB = 1024 * 1024
INDEX = {"_class_name": "FluxPipeline", "transformer": ["diffusers", "FluxTransformer2DModel"]}


def _multipart(s3: Any, bucket: str, key: str, data: bytes, part: int = 5 * MiB) -> None:
    upload = s3.create_multipart_upload(Bucket=bucket, Key=key)
    parts = []
    for n, start in enumerate(range(0, len(data), part), 1):
        sent = s3.upload_part(
            Bucket=bucket, Key=key, UploadId=upload["UploadId"], PartNumber=n,
            Body=data[start : start + part],
        )  # fmt: skip
        parts.append({"PartNumber": n, "ETag": sent["ETag"]})
    s3.complete_multipart_upload(
        Bucket=bucket, Key=key, UploadId=upload["UploadId"], MultipartUpload={"Parts": parts}
    )


def _synthetic(s3: Any, bucket: str, prefix: str, size: int = 12 * MiB) -> bytes:
    """A pipeline of one component: its weights uploaded in 5 MiB parts, its config
    with a SHA-256 checksum, and files a pipeline does not need beside them."""
    weights = os.urandom(size)
    put = s3.put_object
    put(Bucket=bucket, Key=f"{prefix}/model_index.json", Body=json.dumps(INDEX).encode())
    put(Bucket=bucket, Key=f"{prefix}/transformer/config.json", Body=b"{}",
        ChecksumAlgorithm="SHA256")  # fmt: skip
    _multipart(s3, bucket, f"{prefix}/transformer/diffusion_pytorch_model.safetensors", weights)
    put(Bucket=bucket, Key=f"{prefix}/transformer/diffusion_pytorch_model.bin", Body=b"pickle")
    put(Bucket=bucket, Key=f"{prefix}/flux1-dev.safetensors", Body=b"single file")
    put(Bucket=bucket, Key=f"{prefix}/README.md", Body=b"# readme")
    return weights


def test_a_fetch_plans_verifies_each_digest_and_publishes(
    s3_server: S3Server, aws_env: dict[str, str], tiny_model: Path, tmp_path: Path
) -> None:
    s3 = s3_server.client()
    bucket = s3_server.new_bucket()
    upload_folder(s3, bucket, "tiny", tiny_model, sha256=True)
    s3.put_object(Bucket=bucket, Key="tiny/tiny.safetensors", Body=b"a single-file duplicate")
    s3.put_object(Bucket=bucket, Key="tiny/vae/diffusion_pytorch_model.bin", Body=b"pickle")
    said: list[str] = []
    folder = local_folder(f"s3://{bucket}/tiny", tmp_path / "cache", say=said.append, bar=False)
    wanted = sorted(str(p.relative_to(tiny_model)) for p in tiny_model.rglob("*") if p.is_file())
    got = sorted(str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file())
    assert got == wanted  # not the duplicate, not the pickle
    for name in wanted:
        assert (folder / name).read_bytes() == (tiny_model / name).read_bytes()
    total = sum((tiny_model / n).stat().st_size for n in wanted)
    assert said == [f"plan: s3://{bucket}/tiny/ at {said[0].split(' at ')[1].split(':')[0]}: "
                    f"{len(wanted)} files, {said[0].split(', ')[1]}"]  # fmt: skip
    assert f"({total} bytes)" in said[0]
    record = json.loads((folder.parent / "entry.json").read_text())
    assert {f["digest"] for f in record["files"]} == {"sha256"}
    assert record["total_bytes"] == total
    progress = json.loads(
        folder.parent.with_name(folder.parent.name + ".progress.json").read_text()
    )
    assert (
        progress["state"] == "ready" and progress["bytes_done"] == progress["bytes_total"] == total
    )
    # Fetched again: the same folder, nothing moved.
    assert local_folder(f"s3://{bucket}/tiny", tmp_path / "cache", bar=False) == folder


def test_etag_md5_and_multipart_digests(
    s3_server: S3Server, aws_env: dict[str, str], tmp_path: Path
) -> None:
    s3 = s3_server.client()
    bucket = s3_server.new_bucket()
    weights = _synthetic(s3, bucket, "m")
    folder = local_folder(f"s3://{bucket}/m", tmp_path / "cache", bar=False)
    assert (folder / "transformer" / "diffusion_pytorch_model.safetensors").read_bytes() == weights
    assert sorted(str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file()) == [
        "model_index.json",
        "transformer/config.json",
        "transformer/diffusion_pytorch_model.safetensors",
    ]
    record = json.loads((folder.parent / "entry.json").read_text())
    digests = {f["path"]: (f["digest"], f.get("part_size")) for f in record["files"]}
    assert digests == {
        "model_index.json": ("md5", None),
        "transformer/config.json": ("sha256", None),
        "transformer/diffusion_pytorch_model.safetensors": ("md5-parts", 5 * MiB),
    }


def test_a_dry_run_prints_the_plan_and_moves_no_file(
    s3_server: S3Server,
    aws_env: dict[str, str],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    from dpserve.cli import main

    bucket = s3_server.new_bucket()
    weights = _synthetic(s3_server.client(), bucket, "m", size=6 * MiB)
    cache = tmp_path / "cache"
    assert main(["fetch", f"s3://{bucket}/m", "--model-cache", str(cache), "--dry-run"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["source"] == f"s3://{bucket}/m/" and plan["revision"].startswith("listing-")
    assert plan["total_bytes"] == len(weights) + 2 + len(json.dumps(INDEX))
    assert [f["path"] for f in plan["files"]] == [
        "model_index.json",
        "transformer/config.json",
        "transformer/diffusion_pytorch_model.safetensors",
    ]
    assert not cache.exists() or not list(cache.rglob("*.safetensors*"))


def test_a_corrupt_object_is_an_error_naming_it_and_nothing_is_published(
    s3_server: S3Server, aws_env: dict[str, str], tmp_path: Path
) -> None:
    s3 = s3_server.client()
    bucket = s3_server.new_bucket()
    _synthetic(s3, bucket, "m", size=6 * MiB)
    on_disk = s3_server.object_path(bucket, "m/transformer/diffusion_pytorch_model.safetensors")
    data = bytearray(on_disk.read_bytes())
    data[100] ^= 0xFF  # same length: only the digest can tell
    on_disk.write_bytes(bytes(data))
    cache = tmp_path / "cache"
    with pytest.raises(DigestMismatch) as refused:
        local_folder(f"s3://{bucket}/m", cache, bar=False)
    message = str(refused.value)
    assert f"transformer/diffusion_pytorch_model.safetensors from s3://{bucket}/m/ is corrupt" in (
        message
    )
    assert not list(cache.glob("entries/*/*/entry.json"))  # nothing published
    assert not [p for p in cache.rglob("*.safetensors*") if p.is_file()]  # the bytes are gone
    progress = json.loads(next(cache.glob("entries/*/*.progress.json")).read_text())
    assert progress["state"] == "failed" and "is corrupt" in progress["error"]


def test_a_missing_bucket_and_a_non_pipeline_are_clear_errors(
    s3_server: S3Server, aws_env: dict[str, str], tmp_path: Path
) -> None:
    with pytest.raises(SourceError, match="NoSuchBucket: the bucket does not exist"):
        local_folder("s3://no-such-bucket-here/m", tmp_path, bar=False)
    bucket = s3_server.new_bucket()
    wrong = "not-" + aws_env["AWS_SECRET_ACCESS_KEY"]
    with pytest.MonkeyPatch.context() as env:
        env.setenv("AWS_SECRET_ACCESS_KEY", wrong)
        with pytest.raises(SourceError) as refused:
            local_folder(f"s3://{bucket}/m", tmp_path, bar=False)
    assert "check AWS_SECRET_ACCESS_KEY" in str(refused.value) and wrong not in str(refused.value)
    with pytest.MonkeyPatch.context() as env:
        for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
            env.delenv(name)
        env.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
        env.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
        env.setenv("AWS_EC2_METADATA_DISABLED", "true")
        with pytest.raises(SourceError, match="no S3 credentials: set AWS_ACCESS_KEY_ID"):
            local_folder(f"s3://{bucket}/m", tmp_path, bar=False)
    s3_server.client().put_object(Bucket=bucket, Key="m/unet/config.json", Body=b"{}")
    with pytest.raises(SourceError, match=r"holds no model_index\.json"):
        local_folder(f"s3://{bucket}/m", tmp_path, bar=False)


def _fetch(
    model: str, cache: Path, endpoint: str, env: dict[str, str], *flags: str
) -> subprocess.Popen[str]:
    cmd = [sys.executable, "-m", "dpserve", "fetch", model, "--model-cache", str(cache), *flags]
    child_env = {**os.environ, **env, "AWS_ENDPOINT_URL": endpoint}
    return subprocess.Popen(
        cmd, env=child_env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )


def test_a_killed_fetch_resumes_where_it_stopped(
    s3_server: S3Server, aws_env: dict[str, str], tmp_path: Path
) -> None:
    s3 = s3_server.client()
    bucket = s3_server.new_bucket()
    size = 24 * MiB
    weights = _synthetic(s3, bucket, "m", size=size)
    cache = tmp_path / "cache"
    with CountingProxy(s3_server.endpoint_url, rate_bytes_per_s=4 * MiB) as proxy:
        first = _fetch(f"s3://{bucket}/m", cache, proxy.url, aws_env)
        part = "entries/*/*.partial/model/transformer/diffusion_pytorch_model.safetensors.part"

        def halfway() -> int:
            sizes = [p.stat().st_size for p in cache.glob(part)]
            return sizes[0] if sizes and sizes[0] > 8 * MiB else 0

        eventually(halfway, 60, "the first fetch to have 8 MiB of the weights")
        first.kill()
        first.wait(10)
        kept = next(cache.glob(part)).stat().st_size
        assert kept < size
        before = proxy.sent
        proxy.rate = None
        second = _fetch(f"s3://{bucket}/m", cache, proxy.url, aws_env)
        out, err = second.communicate(timeout=120)
        assert second.returncode == 0, err
        moved = proxy.sent - before
    folder = Path(out.strip().splitlines()[-1])
    assert (folder / "transformer" / "diffusion_pytorch_model.safetensors").read_bytes() == weights
    assert size - kept <= moved < size - kept + 256 * 1024  # the rest, and requests' overhead
    # The fetch's own count agrees: what the first one finished or kept was done, not
    # moved again (the small files were finished in the first run).
    progress = json.loads(next(cache.glob("entries/*/*.progress.json")).read_text())
    assert progress["bytes_done"] == progress["bytes_total"]
    assert progress["bytes_moved"] == size - kept


def test_a_fill_jobs_fetch_reports_progress_lines_and_its_outcome(
    s3_server: S3Server, aws_env: dict[str, str], tmp_path: Path
) -> None:
    """What the operator reads of a fill Job's pod: JSON progress lines on stdout (its
    log), the outcome in the termination message file, and the exit code its Job's
    podFailurePolicy tells apart: 0 fetched, 3 refused (no retry), 1 worth a retry."""
    s3 = s3_server.client()
    bucket = s3_server.new_bucket()
    size = 12 * MiB
    _synthetic(s3, bucket, "m", size=size)
    cache, result = tmp_path / "cache", tmp_path / "termination-log"
    flags = ["--json-lines", "--result-file", str(result)]
    with CountingProxy(s3_server.endpoint_url, rate_bytes_per_s=4 * MiB) as proxy:
        done = _fetch(f"s3://{bucket}/m", cache, proxy.url, aws_env, *flags)
        out, err = done.communicate(timeout=120)
    assert done.returncode == 0, err
    lines = [json.loads(line) for line in out.splitlines()]  # stdout is JSON only
    progress = [x for x in lines if x["event"] == "progress"]
    assert len(progress) >= 2 and progress[0]["bytes_total"] > size
    assert progress[0]["revision"].startswith("listing-")
    assert any(0 < x["bytes_done"] < x["bytes_total"] for x in progress)  # seen mid-way
    outcome = json.loads(result.read_text())
    assert lines[-1] == {"event": "result", **outcome}
    assert outcome["state"] == "ready" and outcome["revision"] == progress[0]["revision"]
    assert (Path(outcome["folder"]) / "model_index.json").is_file()
    assert outcome["bytes_total"] == progress[0]["bytes_total"]
    assert aws_env["AWS_SECRET_ACCESS_KEY"] not in out + err

    # A corrupt object is a refusal: exit 3, the file named in the outcome.
    bad = s3_server.new_bucket()
    _synthetic(s3, bad, "m", size=6 * MiB)
    on_disk = s3_server.object_path(bad, "m/transformer/diffusion_pytorch_model.safetensors")
    data = bytearray(on_disk.read_bytes())
    data[7] ^= 0xFF
    on_disk.write_bytes(bytes(data))
    refused = _fetch(f"s3://{bad}/m", cache, s3_server.endpoint_url, aws_env, *flags)
    out, _ = refused.communicate(timeout=120)
    assert refused.returncode == 3
    outcome = json.loads(result.read_text())
    assert outcome["state"] == "failed" and not outcome["retried"]
    assert "transformer/diffusion_pytorch_model.safetensors" in outcome["error"]
    assert json.loads(out.splitlines()[-1])["event"] == "result"
    # A store that does not answer may answer later: exit 1, a Job tries again.
    unreachable = _fetch(f"s3://{bucket}/m2", cache, "http://127.0.0.1:9", aws_env, *flags)
    unreachable.communicate(timeout=120)
    assert unreachable.returncode == 1 and json.loads(result.read_text())["retried"]


def test_a_pin_names_the_revision_and_folder_then_a_node_fetches_only_that(
    s3_server: S3Server, aws_env: dict[str, str], tmp_path: Path
) -> None:
    """A node-local cache's two steps (docs/models.md, Node-local caches): the operator's
    Job pins (``--pin``: nothing fetched, nothing written), each node's init container
    fetches that revision (``--expect-revision``) and prunes its older entries
    (``--prune-keep``); a bucket changed since the pin is refused (exit 3)."""
    s3 = s3_server.client()
    bucket = s3_server.new_bucket()
    _synthetic(s3, bucket, "m", size=1 * MiB)
    cache, result = tmp_path / "cache", tmp_path / "termination-log"
    with CountingProxy(s3_server.endpoint_url) as proxy:
        pin = _fetch(f"s3://{bucket}/m", cache, proxy.url, aws_env, "--pin",
                     "--result-file", str(result))  # fmt: skip
        _, err = pin.communicate(timeout=120)
        assert pin.returncode == 0, err
        assert proxy.sent < 64 * 1024  # the listing and model_index.json only
    pinned = json.loads(result.read_text())
    assert not cache.exists()
    assert pinned["state"] == "pinned" and pinned["revision"].startswith("listing-")
    assert pinned["fetch"] == f"s3://{bucket}/m/"
    assert pinned["bytes_total"] > MiB and pinned["files"] == 3
    folder = Path(pinned["folder"])
    assert folder == cache / "entries" / folder.parent.parent.name / pinned["revision"] / "model"

    # Two replicas' init containers on one node, at once: one fill between them.
    flags = ["--json-lines", "--expect-revision", pinned["revision"], "--prune-keep", "0"]
    with CountingProxy(s3_server.endpoint_url, rate_bytes_per_s=4 * MiB) as proxy:
        fetches = [_fetch(pinned["fetch"], cache, proxy.url, aws_env, *flags) for _ in range(2)]
        outputs = [f.communicate(timeout=120) for f in fetches]
        assert [f.returncode for f in fetches] == [0, 0], outputs
        assert pinned["bytes_total"] <= proxy.sent < pinned["bytes_total"] + 64 * 1024
    for out, _ in outputs:
        outcome = json.loads(out.splitlines()[-1])
        assert Path(outcome["folder"]) == folder and (folder / "model_index.json").is_file()

    # The bucket changes after the pin: a node that fetches now refuses, naming both.
    put = s3.put_object
    put(Bucket=bucket, Key="m/transformer/config.json", Body=b'{"changed": 1}')
    shutil.rmtree(cache)
    refused = _fetch(pinned["fetch"], cache, s3_server.endpoint_url, aws_env, *flags)
    out, _ = refused.communicate(timeout=120)
    assert refused.returncode == 3
    error = json.loads(out.splitlines()[-1])["error"]
    assert "pinned to" in error and pinned["revision"] in error

    # A ready pinned entry needs no store at all; a new revision's fetch prunes the old.
    first = local_folder(pinned["fetch"], cache)  # fetches the changed listing's entry
    again = _fetch(pinned["fetch"], cache, "http://127.0.0.1:9", aws_env,
                   "--expect-revision", first.parent.name)  # fmt: skip
    out, err = again.communicate(timeout=120)
    assert again.returncode == 0 and out.strip() == str(first), err
    put(Bucket=bucket, Key="m/transformer/config.json", Body=b'{"changed": 2}')
    newest = _fetch(pinned["fetch"], cache, s3_server.endpoint_url, aws_env, "--prune-keep", "0")
    out, err = newest.communicate(timeout=120)
    assert newest.returncode == 0, err
    entries = sorted(p.name for p in first.parent.parent.iterdir() if p.is_dir())
    assert entries == [Path(out.strip()).parent.name], entries


def test_two_concurrent_fetches_download_once_and_show_no_credentials(
    s3_server: S3Server, aws_env: dict[str, str], tmp_path: Path
) -> None:
    s3 = s3_server.client()
    bucket = s3_server.new_bucket()
    size = 16 * MiB
    _synthetic(s3, bucket, "m", size=size)
    cache = tmp_path / "cache"
    with CountingProxy(s3_server.endpoint_url, rate_bytes_per_s=8 * MiB) as proxy:
        fetches = [_fetch(f"s3://{bucket}/m", cache, proxy.url, aws_env) for _ in range(2)]
        outputs = [f.communicate(timeout=120) for f in fetches]
        assert [f.returncode for f in fetches] == [0, 0], outputs
        moved = proxy.sent
    assert size <= moved < size + 256 * 1024  # one model's bytes, not two
    folders = {out.strip().splitlines()[-1] for out, _ in outputs}
    assert len(folders) == 1
    assert sum("waiting for it" in err for _, err in outputs) == 1
    for out, _ in outputs:
        assert out.splitlines()[0].startswith(f"plan: s3://{bucket}/m/ at listing-")
    # No credential in any output or file the fetch wrote.
    written = [p.read_text() for p in cache.rglob("*.json")]
    for text in [*written, *(o for pair in outputs for o in pair)]:
        assert aws_env["AWS_SECRET_ACCESS_KEY"] not in text
        assert aws_env["AWS_ACCESS_KEY_ID"] not in text


def test_serve_fetches_once_for_its_replicas_and_answers(
    s3_server: S3Server, aws_env: dict[str, str], tiny_model: Path, tmp_path: Path
) -> None:
    s3 = s3_server.client()
    bucket = s3_server.new_bucket()
    upload_folder(s3, bucket, "tiny", tiny_model)
    total = sum(p.stat().st_size for p in tiny_model.rglob("*") if p.is_file())
    with CountingProxy(s3_server.endpoint_url) as proxy:
        os.environ["AWS_ENDPOINT_URL"] = proxy.url  # (restored by aws_env's monkeypatch)
        cache = tmp_path / "cache"
        model = f"s3://{bucket}/tiny"
        with ServeProcess(model, 2, "--model-cache", str(cache)) as serve:
            reply = serve.http.post(
                "/v1/images/generations",
                json={"prompt": "a boat", "size": "64x64", "num_inference_steps": 2, "seed": 1},
            )
            assert reply.status_code == 200, reply.text
            assert base64.b64decode(reply.json()["data"][0]["b64_json"]).startswith(b"\x89PNG")
            assert serve.http.get("/v1/models").json()["data"][0]["id"] == "tiny"
            loaded = {
                Path(c[c.index("--model") + 1])
                for r in range(2)
                for c in [serve.replica_supervisor(r).cmdline()]
            }
            assert len(loaded) == 1 and next(iter(loaded)).is_relative_to(cache)
        assert total <= proxy.sent < total + 256 * 1024  # one model for two replicas


def test_two_workers_on_one_cache_fetch_once_then_serve(
    s3_server: S3Server, aws_env: dict[str, str], tiny_model: Path, tmp_path: Path
) -> None:
    from dpserve.local import WorkerProcess

    s3 = s3_server.client()
    bucket = s3_server.new_bucket()
    upload_folder(s3, bucket, "tiny", tiny_model)
    total = sum(p.stat().st_size for p in tiny_model.rglob("*") if p.is_file())
    cache = tmp_path / "cache"
    model = f"s3://{bucket}/tiny"
    with CountingProxy(s3_server.endpoint_url) as proxy:
        os.environ["AWS_ENDPOINT_URL"] = proxy.url  # (restored by aws_env's monkeypatch)
        workers = [
            WorkerProcess(model, "--model-cache", str(cache), wait=False)  # type: ignore[arg-type]
            for _ in range(2)
        ]
        try:
            for worker in workers:
                worker.wait_ready(180)
                with worker.client() as client:
                    assert client.ping(timeout_s=10).status == "ok"
        finally:
            for worker in workers:
                worker.kill()
        assert total <= proxy.sent < total + 256 * 1024  # one fill for both
    assert len(list(cache.glob("entries/*/*/entry.json"))) == 1
