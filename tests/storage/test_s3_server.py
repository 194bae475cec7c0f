"""The test S3 server does what the model sources rely on, proven through boto3.

Every check goes through the real server (tests/storage/s3.py) the way dpserve and
its users reach a store: a boto3 client, the standard ``AWS_*`` variables, and plain
HTTP for presigned URLs.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import shutil
import subprocess
import sys
import urllib.error
import urllib.request
import zlib
from collections.abc import Callable
from pathlib import Path

import pytest
from botocore.config import Config
from botocore.exceptions import ClientError, FlexibleChecksumError

from tests.polling import eventually
from tests.storage.s3 import HERE, S3BuildError, S3Server, build_server, running_s3

pytestmark = [pytest.mark.e2e, pytest.mark.s3]

MiB = 1024 * 1024


def _http_get(url: str) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=10) as reply:
            return reply.status, reply.read()
    except urllib.error.HTTPError as refused:
        return refused.code, refused.read()


def _refusal(call: Callable[[], object]) -> tuple[int, str]:
    """The HTTP status and S3 error code that ``call`` was refused with."""
    with pytest.raises(ClientError) as caught:
        call()
    reply = caught.value.response
    return reply["ResponseMetadata"]["HTTPStatusCode"], str(reply["Error"]["Code"])


def _error_code(call: Callable[[], object]) -> str:
    return _refusal(call)[1]


def _sha256_b64(data: bytes) -> str:
    return base64.b64encode(hashlib.sha256(data).digest()).decode()


def _md5_b64(data: bytes) -> str:
    return base64.b64encode(hashlib.md5(data).digest()).decode()


def test_put_head_get_with_md5_etag_and_user_metadata(s3_server: S3Server) -> None:
    s3, bucket = s3_server.client(), s3_server.new_bucket()
    data = os.urandom(100_000)

    put = s3.put_object(Bucket=bucket, Key="m/a.bin", Body=data, Metadata={"Sha256": "abc"})
    head = s3.head_object(Bucket=bucket, Key="m/a.bin")

    md5 = f'"{hashlib.md5(data).hexdigest()}"'
    assert put["ETag"] == head["ETag"] == md5
    assert head["ContentLength"] == len(data)
    assert head["Metadata"] == {"sha256": "abc"}  # names come back lower-cased, as on AWS
    assert s3.get_object(Bucket=bucket, Key="m/a.bin")["Body"].read() == data
    assert s3_server.object_path(bucket, "m/a.bin").read_bytes() == data


def test_ranged_get_from_an_offset_to_the_end(s3_server: S3Server) -> None:
    s3, bucket = s3_server.client(), s3_server.new_bucket()
    data = os.urandom(4096)
    s3.put_object(Bucket=bucket, Key="w", Body=data)

    got = s3.get_object(Bucket=bucket, Key="w", Range="bytes=4000-")

    assert got["Body"].read() == data[4000:]
    assert got["ContentRange"] == "bytes 4000-4095/4096"
    assert got["ContentLength"] == 96


def test_multipart_upload_joins_parts_with_the_s3_etag(s3_server: S3Server) -> None:
    s3, bucket = s3_server.client(), s3_server.new_bucket()
    data = os.urandom(2 * 5 * MiB + 123)  # two minimum-size parts and a short last one
    parts = [data[i : i + 5 * MiB] for i in range(0, len(data), 5 * MiB)]
    upload = s3.create_multipart_upload(Bucket=bucket, Key="big", Metadata={"role": "weights"})
    done = [
        {"PartNumber": n, "ETag": s3.upload_part(
            Bucket=bucket, Key="big", UploadId=upload["UploadId"], PartNumber=n, Body=part
        )["ETag"]}
        for n, part in enumerate(parts, 1)
    ]  # fmt: skip

    s3.complete_multipart_upload(
        Bucket=bucket, Key="big", UploadId=upload["UploadId"], MultipartUpload={"Parts": done}
    )

    # S3's multipart ETag: the MD5 of the parts' MD5s, then "-<parts>" (not the data's MD5).
    joined = hashlib.md5(b"".join(hashlib.md5(p).digest() for p in parts)).hexdigest()
    head = s3.head_object(Bucket=bucket, Key="big")
    assert head["ETag"] == f'"{joined}-3"'
    assert head["ContentLength"] == len(data)
    assert head["Metadata"] == {"role": "weights"}
    assert s3.get_object(Bucket=bucket, Key="big")["Body"].read() == data


def test_list_v2_by_prefix_in_pages(s3_server: S3Server) -> None:
    s3, bucket = s3_server.client(), s3_server.new_bucket()
    wanted = [f"model/unet/{i}.safetensors" for i in range(5)]
    for key in [*wanted, "other/x", "modelling"]:
        s3.put_object(Bucket=bucket, Key=key, Body=key.encode())

    pages, token = [], None
    while True:
        more = {"ContinuationToken": token} if token else {}
        page = s3.list_objects_v2(Bucket=bucket, Prefix="model/", MaxKeys=2, **more)
        pages.append([o["Key"] for o in page.get("Contents", [])])
        if not page["IsTruncated"]:
            break
        token = page["NextContinuationToken"]

    assert pages == [wanted[0:2], wanted[2:4], wanted[4:5]]
    sizes = {
        o["Key"]: o["Size"] for o in s3.list_objects_v2(Bucket=bucket, Prefix="model/")["Contents"]
    }
    assert sizes == {key: len(key) for key in wanted}


def test_presigned_get_works_over_plain_http_then_expires(s3_server: S3Server) -> None:
    s3, bucket = s3_server.client(), s3_server.new_bucket()
    s3.put_object(Bucket=bucket, Key="img.png", Body=b"picture")
    url = s3.generate_presigned_url(
        "get_object", Params={"Bucket": bucket, "Key": "img.png"}, ExpiresIn=2
    )

    assert _http_get(url) == (200, b"picture")
    assert _http_get(url.replace("img.png", "other.png"))[0] == 403  # signed for one key
    eventually(lambda: _http_get(url)[0] == 403, timeout_s=15, what="the presigned URL to expire")
    assert b"expired" in _http_get(url)[1]


def test_boto3s_default_sigv2_presigned_url_is_refused(s3_server: S3Server) -> None:
    """Why ``S3Server.client()`` says SigV4: boto3 presigns with SigV2 unless configured,
    and this server, like AWS, answers such a URL with an error that names SigV4."""
    s3, bucket = s3_server.client(), s3_server.new_bucket()
    s3.put_object(Bucket=bucket, Key="k", Body=b"v")
    default = s3_server.client(config=Config())  # boto3's defaults

    url = default.generate_presigned_url("get_object", Params={"Bucket": bucket, "Key": "k"})

    assert "Signature=" in url and "X-Amz-Signature" not in url
    status, body = _http_get(url)
    assert status == 400 and b"AWS4-HMAC-SHA256" in body


def test_the_standard_aws_variables_configure_a_plain_client(s3_server: S3Server) -> None:
    """A process given only ``env()`` (no endpoint or key in code) reaches the server,
    as a user's pod given the variables from a Secret does."""
    s3, bucket = s3_server.client(), s3_server.new_bucket()
    s3.put_object(Bucket=bucket, Key="cfg.json", Body=b"{}")
    code = (
        "import boto3, json, sys; s3 = boto3.client('s3'); "
        "keys = [o['Key'] for o in s3.list_objects_v2(Bucket=sys.argv[1])['Contents']]; "
        "body = s3.get_object(Bucket=sys.argv[1], Key='cfg.json')['Body'].read().decode(); "
        "print(json.dumps([keys, body]))"
    )
    clean = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    env = clean | s3_server.env() | {"AWS_CONFIG_FILE": "/dev/null"}

    out = subprocess.run(
        [sys.executable, "-c", code, bucket], env=env, capture_output=True, text=True, timeout=60
    )

    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout) == [["cfg.json"], "{}"]


def test_credentials_are_checked(s3_server: S3Server) -> None:
    bucket = s3_server.new_bucket()
    s3_server.client().put_object(Bucket=bucket, Key="k", Body=b"v")
    wrong_secret = s3_server.client(aws_secret_access_key=s3_server.secret_key[::-1])
    wrong_key = s3_server.client(aws_access_key_id="AKIANOTTHEKEY0000000")

    assert _refusal(lambda: wrong_secret.get_object(Bucket=bucket, Key="k")) == (
        403, "SignatureDoesNotMatch"
    )  # fmt: skip
    # AWS answers 403 InvalidAccessKeyId; versitygw 404 with a code of its own. Code
    # that reads "404" as "no such object" must look at the error code too.
    assert _refusal(lambda: wrong_key.list_objects_v2(Bucket=bucket)) == (404, "XAdminUserNotFound")
    assert _http_get(f"{s3_server.endpoint_url}/{bucket}/k")[0] == 403  # anonymous


def test_sha256_checksum_is_stored_returned_and_enforced(s3_server: S3Server) -> None:
    s3, bucket = s3_server.client(), s3_server.new_bucket()
    data = os.urandom(50_000)

    put = s3.put_object(Bucket=bucket, Key="w.safetensors", Body=data, ChecksumAlgorithm="SHA256")

    want = _sha256_b64(data)
    head = s3.head_object(Bucket=bucket, Key="w.safetensors", ChecksumMode="ENABLED")
    attrs = s3.get_object_attributes(
        Bucket=bucket, Key="w.safetensors", ObjectAttributes=["Checksum"]
    )
    assert put["ChecksumSHA256"] == head["ChecksumSHA256"] == want
    assert attrs["Checksum"] == {"ChecksumSHA256": want, "ChecksumType": "FULL_OBJECT"}
    # A put whose stated checksum does not match its bytes is refused, not stored.
    bad = lambda: s3.put_object(  # noqa: E731
        Bucket=bucket, Key="bad", Body=data, ChecksumSHA256=_sha256_b64(data + b"x")
    )
    assert _error_code(bad) == "BadDigest"
    bad_md5 = lambda: s3.put_object(  # noqa: E731
        Bucket=bucket, Key="bad", Body=data, ContentMD5=_md5_b64(data + b"x")
    )
    assert _error_code(bad_md5) == "BadDigest"
    assert _error_code(lambda: s3.head_object(Bucket=bucket, Key="bad")) == "404"


def test_boto3_puts_a_crc32_by_default_and_the_server_keeps_it(s3_server: S3Server) -> None:
    s3, bucket = s3_server.client(), s3_server.new_bucket()
    data = b"config" * 100

    s3.put_object(Bucket=bucket, Key="c.json", Body=data)

    head = s3.head_object(Bucket=bucket, Key="c.json", ChecksumMode="ENABLED")
    crc = base64.b64encode(zlib.crc32(data).to_bytes(4, "big")).decode()
    assert head["ChecksumCRC32"] == crc
    assert "ChecksumSHA256" not in head  # only when the uploader asked for it


def test_multipart_sha256_is_a_checksum_of_part_checksums(s3_server: S3Server) -> None:
    """A multipart object's SHA256 is COMPOSITE (over the parts' digests, then "-N"):
    it cannot be compared with a file's own SHA256, only recomputed part by part."""
    s3, bucket = s3_server.client(), s3_server.new_bucket()
    data = os.urandom(5 * MiB + 10)
    parts = [data[: 5 * MiB], data[5 * MiB :]]
    upload = s3.create_multipart_upload(Bucket=bucket, Key="m", ChecksumAlgorithm="SHA256")
    done = []
    for n, part in enumerate(parts, 1):
        sent = s3.upload_part(Bucket=bucket, Key="m", UploadId=upload["UploadId"],
                              PartNumber=n, Body=part, ChecksumAlgorithm="SHA256")  # fmt: skip
        assert sent["ChecksumSHA256"] == _sha256_b64(part)
        done.append(
            {"PartNumber": n, "ETag": sent["ETag"], "ChecksumSHA256": sent["ChecksumSHA256"]}
        )
    s3.complete_multipart_upload(
        Bucket=bucket, Key="m", UploadId=upload["UploadId"], MultipartUpload={"Parts": done}
    )

    head = s3.head_object(Bucket=bucket, Key="m", ChecksumMode="ENABLED")
    of_parts = hashlib.sha256(b"".join(hashlib.sha256(p).digest() for p in parts)).digest()
    assert head["ChecksumSHA256"] == f"{base64.b64encode(of_parts).decode()}-2"
    assert head["ChecksumType"] == "COMPOSITE"


def test_an_object_corrupted_on_disk_fails_boto3s_checksum_check(s3_server: S3Server) -> None:
    """The server keeps the checksum it recorded at put time; boto3 (>= 1.36) checks a
    whole-object GET against it and raises when the bytes on disk changed. A GET of part
    of the object (a resumed download) carries no checksum: the caller must check."""
    s3, bucket = s3_server.client(), s3_server.new_bucket()
    data = os.urandom(10_000)
    s3.put_object(Bucket=bucket, Key="w", Body=data, ChecksumAlgorithm="SHA256")
    with s3_server.object_path(bucket, "w").open("r+b") as on_disk:
        on_disk.seek(5000)
        on_disk.write(bytes([data[5000] ^ 0xFF]))

    whole = s3.get_object(Bucket=bucket, Key="w")
    part = s3.get_object(Bucket=bucket, Key="w", Range="bytes=4000-")

    assert whole["ChecksumSHA256"] == _sha256_b64(data)  # the recorded one, not the disk's
    with pytest.raises(FlexibleChecksumError):
        whole["Body"].read()
    assert "ChecksumSHA256" not in part
    assert part["Body"].read()[1000] == data[5000] ^ 0xFF  # served as it is


def test_running_s3_stops_the_server_and_removes_its_folder(tmp_path: Path) -> None:
    binary = build_server()
    with pytest.raises(RuntimeError, match="the test failed"), running_s3(binary, tmp_path) as s3:
        workdir = s3.root.parent
        s3.new_bucket()
        assert workdir.is_dir()
        raise RuntimeError("the test failed")

    assert not workdir.exists()
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(Exception, match="Could not connect"):
        s3.client(config=Config(retries={"max_attempts": 1})).list_buckets()


def test_running_s3_listens_on_the_address_it_is_given(tmp_path: Path) -> None:
    with running_s3(build_server(), tmp_path, host="127.0.0.2") as s3:
        bucket = s3.new_bucket()
        s3.client().put_object(Bucket=bucket, Key="k", Body=b"v")

        assert s3.endpoint_url.startswith("http://127.0.0.2:")
        port = s3.endpoint_url.rsplit(":", 1)[1]
        elsewhere = s3.client(endpoint_url=f"http://127.0.0.1:{port}",
                              config=Config(retries={"max_attempts": 1}))  # fmt: skip
        with pytest.raises(Exception, match="Could not connect"):
            elsewhere.list_buckets()


def _path_without_go(tmp_path: Path) -> str:
    """A PATH holding the tools build.sh uses but no ``go``, wherever Go is installed."""
    tools = tmp_path / "tools"
    tools.mkdir()
    for tool in ("bash", "dirname", "sed", "head", "cat", "sha256sum", "cut", "mkdir", "flock",
                 "rm", "mktemp", "mv", "date"):  # fmt: skip
        found = shutil.which(tool)
        assert found, tool
        (tools / tool).symlink_to(found)
    return str(tools)


def test_build_without_go_says_what_to_install_and_leaves_no_binary(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("DPSERVE_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("PATH", _path_without_go(tmp_path))

    with pytest.raises(S3BuildError, match="go not found on PATH") as failed:
        build_server()

    assert "tests/storage/build.sh" in str(failed.value)
    assert list((tmp_path / "cache").rglob("s3server")) == []


def test_build_is_a_no_op_when_the_binary_is_cached(tmp_path: Path) -> None:
    # The same cache entry as the real build's, in another cache, holding a stand-in.
    entry = build_server().parent.parent.name
    cached = tmp_path / "cache" / "s3" / entry / "bin" / "s3server"
    cached.parent.mkdir(parents=True)
    cached.write_text("#!/bin/sh\n")
    cached.chmod(0o755)
    env = {"PATH": _path_without_go(tmp_path), "DPSERVE_CACHE": str(tmp_path / "cache")}

    out = subprocess.run(["bash", str(HERE / "build.sh")], env=env, capture_output=True, text=True)

    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines()[-1] == str(cached.parent)
