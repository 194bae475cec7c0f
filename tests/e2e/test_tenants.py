"""Tenants end to end: `dpserve serve` with a real tiny video model and a key file that
groups keys into tenants, and a second router (its own process, no state shared) over
the same replica. Another tenant's video job is not there for it; the owner's other
key, and an admin, see it; the owner is recorded on the replica, so the second router
answers alike (docs/tenants.md, "Ownership")."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.servers import RouterProcess, ServeProcess

pytestmark = pytest.mark.e2e

A1, A2, B1, ROOT = "sk-a-first", "sk-a-second", "sk-b-only", "sk-admin"
JOB: dict[str, Any] = {"prompt": "a paper boat", "size": "64x48", "num_frames": 5}
EXTRA = {"seed": 7, "num_inference_steps": 2, "fps": 8}


def _as(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def _completed(http: httpx.Client, job_id: str, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        status = http.get(f"/v1/videos/{job_id}", headers=_as(A1)).json()["status"]
        if status == "completed":
            return
        assert status in ("queued", "in_progress") and time.monotonic() < deadline, status
        time.sleep(0.1)


def _unseen(http: httpx.Client, job_id: str) -> None:
    """team-b: not listed; get, content and delete are 404s."""
    listed = http.get("/v1/videos", headers=_as(B1))
    assert listed.status_code == 200 and job_id not in [j["id"] for j in listed.json()["data"]]
    for method, tail in (("GET", ""), ("GET", "/content"), ("DELETE", "")):
        answer = http.request(method, f"/v1/videos/{job_id}{tail}", headers=_as(B1))
        assert answer.status_code == 404, (method, tail, answer.text)


def _seen(http: httpx.Client, job_id: str) -> None:
    """team-a's other key and the admin: listed, read and downloaded."""
    for key in (A2, ROOT):
        listed = http.get("/v1/videos", headers=_as(key)).json()["data"]
        assert job_id in [j["id"] for j in listed]
        assert http.get(f"/v1/videos/{job_id}", headers=_as(key)).json()["prompt"] == JOB["prompt"]
        mp4 = http.get(f"/v1/videos/{job_id}/content", headers=_as(key))
        assert mp4.status_code == 200 and mp4.headers["content-type"] == "video/mp4"


def _counted(http: httpx.Client, frames: int, timeout_s: float = 30) -> None:
    """The admin's usage shows team-a's frames (once the placing router's watch saw the
    job completed) and none for team-b; a tenant's key may not read it."""
    assert http.get("/v1/usage", headers=_as(B1)).status_code == 403
    deadline = time.monotonic() + timeout_s
    while True:
        usage = http.get("/v1/usage", headers=_as(ROOT)).json()
        made = {t["tenant"]: t["video_frames"] for t in usage["tenants"]}
        if made["team-a"] == frames:
            break
        assert time.monotonic() < deadline, made
        time.sleep(0.1)
    assert made == {"team-a": frames, "team-b": 0, "ops": 0}


def test_a_video_job_is_its_tenants_through_every_router(
    tiny_video_model: Path, tmp_path: Path
) -> None:
    keys, admin = tmp_path / "keys", tmp_path / "admin-keys"
    keys.write_text(f"# team-a has two keys\nteam-a {A1}\nteam-a {A2}\nteam-b {B1}\n")
    admin.write_text(f"ops {ROOT}\n")
    files = ("--api-key-file", str(keys), "--admin-key-file", str(admin))
    shares = ("--max-requests-per-tenant", "4", "--tenant-weight", "team-a=2")
    with ServeProcess(tiny_video_model, 1, *files, *shares, timeout_s=120) as serve:
        made = serve.http.post("/v1/videos", json={**JOB, **EXTRA}, headers=_as(A1))
        assert made.status_code == 200, made.text
        job_id = made.json()["id"]
        _completed(serve.http, job_id)
        _counted(serve.http, frames=made.json()["num_frames"])
        _unseen(serve.http, job_id)
        _seen(serve.http, job_id)
        # Another router process, which never saw the job placed.
        cmd = serve.replica_supervisor(0).cmdline()
        wire = ("--wire-key-file", cmd[cmd.index("--wire-key-file") + 1])
        with RouterProcess([f"tcp://127.0.0.1:{serve.scheduler_port}"], *wire, *files) as other:
            _unseen(other.http, job_id)
            _seen(other.http, job_id)
            deleted = other.http.delete(f"/v1/videos/{job_id}", headers=_as(A2))
            assert deleted.status_code == 200 and deleted.json()["deleted"] is True
        assert serve.http.get(f"/v1/videos/{job_id}", headers=_as(ROOT)).status_code == 404
