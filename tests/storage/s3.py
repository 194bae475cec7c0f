"""A real S3 server for tests: Versity's S3 gateway (versitygw) over a temporary folder.

``running_s3(build_server())`` starts one on a free loopback port with an access key
and secret it makes up, waits until a signed request is answered, and yields an
``S3Server``; on leaving the block it stops the server and removes its folder, also
when the block raised. The posix backend stores a bucket as a directory and an
object as a file under ``S3Server.root`` (metadata and checksums in extended
attributes), so a test can also corrupt an object on disk behind the server's back.
The root credentials reach the server through its environment, never its arguments.
docs/test-storage.md says why this server and what it was checked to do.
"""

from __future__ import annotations

import base64
import os
import secrets
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dpserve.plumbing.ports import free_port

HERE = Path(__file__).resolve().parent
REGION = "us-east-1"  # boto3's default: a client that names none still signs for it


class S3BuildError(RuntimeError):
    """tests/storage/build.sh failed; the message carries its output and the fix."""


def build_server() -> Path:
    """The server's binary, built by tests/storage/build.sh on first use (minutes when
    cold, a no-op afterwards)."""
    done = subprocess.run(["bash", str(HERE / "build.sh")], capture_output=True, text=True)
    if done.returncode != 0:
        raise S3BuildError(
            "tests/storage/build.sh could not build the S3 server the storage tests need "
            f"(exit {done.returncode}); run it by hand to see the whole log:\n"
            f"{done.stderr[-2000:]}"
        )
    return Path(done.stdout.strip().splitlines()[-1]) / "s3server"


@dataclass(frozen=True)
class S3Server:
    endpoint_url: str
    access_key: str
    secret_key: str
    region: str
    root: Path  # the posix backend's folder: bucket/key paths are files here

    def client(self, **overrides: Any) -> Any:
        """A boto3 S3 client for this server.

        SigV4 throughout: boto3 presigns with SigV2 unless told otherwise, which this
        server (like AWS in every region opened since 2014) refuses.
        """
        import boto3
        from botocore.config import Config

        config = Config(signature_version="s3v4", retries={"max_attempts": 2, "mode": "standard"})
        kwargs: dict[str, Any] = {
            "endpoint_url": self.endpoint_url,
            "aws_access_key_id": self.access_key,
            "aws_secret_access_key": self.secret_key,
            "region_name": self.region,
            "config": config,
            **overrides,
        }
        return boto3.client("s3", **kwargs)

    def env(self) -> dict[str, str]:
        """The standard ``AWS_*`` variables that point any AWS SDK or CLI at this server."""
        return {
            "AWS_ENDPOINT_URL": self.endpoint_url,
            "AWS_ACCESS_KEY_ID": self.access_key,
            "AWS_SECRET_ACCESS_KEY": self.secret_key,
            "AWS_DEFAULT_REGION": self.region,
            "AWS_REGION": self.region,
        }

    def object_path(self, bucket: str, key: str) -> Path:
        """Where the server keeps an object's bytes: write here to corrupt it behind the
        server's back (its stored ETag and checksums stay as they were)."""
        return self.root / bucket / key

    def new_bucket(self, prefix: str = "test") -> str:
        """A fresh, empty bucket with a unique name (tests share one server)."""
        name = f"{prefix}-{secrets.token_hex(6)}"
        self.client().create_bucket(Bucket=name)
        return name


def upload_folder(s3: Any, bucket: str, prefix: str, folder: Path, sha256: bool = False) -> None:
    """Every file of ``folder`` under ``prefix/``; ``sha256``: each with a SHA-256
    checksum the store keeps (what a fetch verifies instead of the ETag's MD5)."""
    for path in sorted(folder.rglob("*")):
        if path.is_file():
            extra = {"ChecksumAlgorithm": "SHA256"} if sha256 else {}
            key = f"{prefix}/{path.relative_to(folder)}"
            s3.put_object(Bucket=bucket, Key=key, Body=path.read_bytes(), **extra)


def _credentials() -> tuple[str, str]:
    # A secret shaped like AWS's (40 base64 characters, '/' and '+' included) so a
    # user of env() that mangles either character fails its signature here.
    secret = base64.b64encode(secrets.token_bytes(30)).decode()
    return f"DPSERVETEST{secrets.token_hex(5).upper()}", secret


@contextmanager
def running_s3(
    binary: Path, parent: Path | None = None, timeout_s: float = 30, host: str = "127.0.0.1"
) -> Iterator[S3Server]:
    """A server on a free port of ``host`` in a new folder under ``parent`` (the system's
    temporary folder by default), answering signed requests, for the block. Pods reach
    it where ``host`` is an address of their network (a test node's bridge gateway)."""
    workdir = Path(tempfile.mkdtemp(prefix="dpserve-s3-", dir=parent))
    try:
        root = workdir / "data"
        root.mkdir()
        access_key, secret_key = _credentials()
        # Only the credentials it makes up: none of the runner's own AWS settings.
        env = {k: v for k, v in os.environ.items() if not k.startswith(("AWS_", "ROOT_"))}
        env |= {"ROOT_ACCESS_KEY_ID": access_key, "ROOT_SECRET_ACCESS_KEY": secret_key}
        for _ in range(3):  # another process may bind the picked port first
            port = free_port(host)
            server = S3Server(f"http://{host}:{port}", access_key, secret_key, REGION, root)
            log = workdir / "server.log"
            with log.open("ab") as out:
                proc = subprocess.Popen(
                    [str(binary), "--listen", f"{host}:{port}", "--region", REGION, str(root)],
                    stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
                )  # fmt: skip
            try:
                if _answering(server, proc, log, timeout_s):
                    yield server
                    return
            finally:
                _stop(proc)
        raise RuntimeError(f"the S3 server exited at start three times: {_tail(log)}")
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def _answering(
    server: S3Server, proc: subprocess.Popen[bytes], log: Path, timeout_s: float
) -> bool:
    """True once a signed ListBuckets is answered; False if the server exited first
    (a taken port); raises if it neither answers nor exits within ``timeout_s``."""
    from botocore.config import Config
    from botocore.exceptions import BotoCoreError

    client = server.client(
        config=Config(signature_version="s3v4", connect_timeout=1, read_timeout=2,
                      retries={"max_attempts": 1})
    )  # fmt: skip
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            return False
        try:
            client.list_buckets()
            return True
        except BotoCoreError:  # not listening yet (connection refused)
            time.sleep(0.05)
    raise TimeoutError(f"the S3 server did not answer within {timeout_s}s: {_tail(log)}")


def _stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _tail(log: Path, lines: int = 20) -> str:
    try:
        return "\n".join(log.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"
