"""Video jobs end to end: `dpserve serve --dp-size 2` with a Wan-style video model, the
official `openai` client, real mp4 files, and a job whose owner is killed mid-run."""

from __future__ import annotations

import io
import json
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import av
import numpy as np
import openai
import pytest

from tests.polling import eventually
from tests.readme_examples import run_readme_example, run_shell_example
from tests.servers import ServeProcess

pytestmark = pytest.mark.e2e

JOB: dict[str, Any] = {"prompt": "a paper boat on a pond", "size": "64x48", "seconds": "1"}
EXTRA = {"seed": 7, "num_inference_steps": 3, "fps": 8}  # 1 s at 8 fps: 9 frames
# A job long enough to be seen running and to be stopped mid-run: about 4.5 s with 60
# steps on a quiet machine, most of it decoding and encoding 33 frames (JOB's 9 frames
# take 0.4 s, less than a poll's round trip: it can finish between two looks).
BIG_JOB: dict[str, Any] = {**JOB, "size": "192x144", "seconds": "4"}


@pytest.fixture(scope="module")
def dp2(tiny_video_model: Path) -> Iterator[ServeProcess]:
    with ServeProcess(tiny_video_model, 2, timeout_s=300) as serve:
        yield serve


@pytest.fixture()
def client(dp2: ServeProcess) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=f"{dp2.url}/v1", api_key="unused", max_retries=0) as c:
        yield c


def _frames(mp4: bytes) -> list[Any]:
    with av.open(io.BytesIO(mp4)) as container:
        return [frame.to_ndarray(format="rgb24") for frame in container.decode(video=0)]


def test_the_openai_client_makes_a_video_on_each_replica(client: openai.OpenAI) -> None:
    first = client.videos.create(**JOB, extra_body=EXTRA)
    second = client.videos.create(**JOB, extra_body=EXTRA)
    assert (first.object, first.status, first.size, first.seconds) == (
        "video",
        "queued",
        "64x48",
        "1",
    )
    done = [_poll(client, v.id) for v in (first, second)]
    assert [d.status for d in done] == ["completed", "completed"]
    assert {_extra(d, "replica") for d in done} == {0, 1}  # placed on both replicas
    videos = [client.videos.download_content(d.id).read() for d in done]
    assert videos[0] == videos[1]  # same seed, same layout: the same frames, the same file
    frames = _frames(videos[0])
    assert len(frames) == 9 and frames[0].shape == (48, 64, 3)
    thumbnail = client.videos.download_content(done[0].id, variant="thumbnail").read()
    assert thumbnail[:3] == b"\xff\xd8\xff"  # a JPEG
    listed = [v.id for v in client.videos.list(limit=10)]
    assert {first.id, second.id} <= set(listed)
    other_seed = _poll(client, client.videos.create(**JOB, extra_body={**EXTRA, "seed": 8}).id)
    assert client.videos.download_content(other_seed.id).read() != videos[0]
    deleted = client.videos.delete(first.id)
    assert deleted.deleted
    with pytest.raises(openai.NotFoundError):
        client.videos.retrieve(first.id)


def test_readme_video_example_runs(
    dp2: ServeProcess, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)  # the example writes boat.mp4
    scope = run_readme_example(dp2.port, "videos.create_and_poll")
    assert scope["job"].status == "completed"
    frames = _frames((tmp_path / "boat.mp4").read_bytes())
    assert len(frames) == 17 and frames[0].shape == (48, 64, 3)  # 1 s at 16 fps


def test_the_curl_form_of_every_video_call_runs_as_documented(
    dp2: ServeProcess, tmp_path: Path
) -> None:
    """docs/video.md's calls (create, poll, content, thumbnail, list, delete) and the
    README's short form, run with bash and curl as a user would paste them."""
    docs = run_shell_example("docs/video.md", dp2.port, "-X DELETE", tmp_path)
    assert len(_frames((tmp_path / "boat.mp4").read_bytes())) == 17  # 1 s at 16 fps, +1
    assert (tmp_path / "boat.jpg").read_bytes()[:3] == b"\xff\xd8\xff"
    job = json.loads((tmp_path / "job.json").read_text())
    assert (job["status"], job["size"]) == ("queued", "64x48")
    created, listed, deleted = _json_objects(docs.stdout)  # curl adds no newlines
    assert created == job and job["id"] in [v["id"] for v in listed["data"]]
    assert deleted == {"id": job["id"], "object": "video.deleted", "deleted": True}
    assert dp2.http.get(f"/v1/videos/{job['id']}").status_code == 404
    (tmp_path / "boat.mp4").unlink()
    run_shell_example("README.md", dp2.port, "v1/videos/$id/content", tmp_path)
    frames = _frames((tmp_path / "boat.mp4").read_bytes())
    assert len(frames) == 17 and frames[0].shape == (48, 64, 3)


def test_a_job_reports_its_size_and_estimate_and_an_hours_long_one_is_refused(
    client: openai.OpenAI, dp2: ServeProcess
) -> None:
    """Without a size, the model's default (Wan's 832x480) from the first answer on; once
    a job has finished, the next carries its estimated seconds; the 1280x720, 4 s job
    of the CPU tiny model is a 400 naming the default bound (1800 s) and its estimate."""
    warm = _poll(client, client.videos.create(**JOB, extra_body=EXTRA).id)  # calibrates
    assert warm.status == "completed"
    eventually(lambda: _measured(dp2.http), 30, "the replica's next ping to bring its figure")
    one = {"seed": 3, "num_frames": 1, "num_inference_steps": 1}
    unsized = client.videos.create(prompt="a paper boat", extra_body=one)
    assert unsized.size == "832x480"
    estimate = _extra(unsized, "estimated_time_s")
    assert estimate is not None and 0 < estimate < 1800
    done = _poll(client, unsized.id)
    assert done.status == "completed" and done.size == "832x480", done
    assert _frames(client.videos.download_content(done.id).read())[0].shape == (480, 832, 3)
    big = {"prompt": "a harbour", "size": "1280x720", "seconds": "4"}
    answer = dp2.http.post("/v1/videos", json=big)
    assert answer.status_code == 400, answer.text
    message = answer.json()["error"]["message"]
    assert "(1280x720, 65 frames, 50 steps)" in message and "bound of 1800s" in message
    estimated = int(message.split("estimated to run ")[1].split("s ")[0])
    assert estimated > 1800
    with pytest.raises(openai.BadRequestError, match="bound of 1800s"):
        client.videos.create(prompt="a harbour", size="1280x720", seconds="4")


def test_before_calibration_a_job_runs_at_most_the_bound_and_after_it_is_estimated(
    tiny_video_model: Path,
) -> None:
    """`serve --video-max-estimate 3` on a fresh service: no replica has measured, so a
    long job is taken without an estimate and stopped once it has run 3 s; a short one
    finishes and calibrates; then the long one is refused up front and the short one
    carries its estimate."""
    long = {
        "prompt": "a storm",
        "size": "256x192",
        "num_frames": 33,
        "seed": 1,
        "num_inference_steps": 100,
    }  # fmt: skip  (about 25 s of steps, one thread)
    short = {"prompt": "a boat", "size": "64x48", "num_frames": 9, "seed": 2,
             "num_inference_steps": 2}  # fmt: skip
    with ServeProcess(tiny_video_model, 1, "--video-max-estimate", "3", timeout_s=300) as serve:
        http = serve.http
        taken = http.post("/v1/videos", json=long).json()
        assert taken["estimated_time_s"] is None, taken
        stopped = _poll_http(http, taken["id"])
        assert stopped["status"] == "failed", stopped
        assert stopped["error"]["code"] == "deadline_exceeded"
        assert "bound of 3s" in stopped["error"]["message"]
        assert stopped["progress"] < 95  # stopped in its steps, not run to the end
        first = http.post("/v1/videos", json=short).json()
        assert _poll_http(http, first["id"])["status"] == "completed"
        eventually(lambda: _measured(http), 30, "the replica's next ping to bring its figure")
        refused = http.post("/v1/videos", json=long)
        assert refused.status_code == 400 and "bound of 3s" in refused.text, refused.text
        again = http.post("/v1/videos", json=short).json()
        assert again["estimated_time_s"] is not None and 0 < again["estimated_time_s"] < 3
        assert _poll_http(http, again["id"])["status"] == "completed"


def _measured(http: Any) -> bool:
    replicas = http.get("/health/replicas").json()["replicas"]
    return any(r["calibration"]["seconds_per_unit"] is not None for r in replicas)  # borrowed


def _json_objects(text: str) -> list[Any]:
    decoder, found, at = json.JSONDecoder(), [], 0
    while at < len(text.rstrip()):
        value, at = decoder.raw_decode(text, at)
        found.append(value)
        at += len(text[at:]) - len(text[at:].lstrip())
    return found


def _poll_http(http: Any, job_id: str, timeout_s: float = 120.0) -> dict[str, Any]:
    deadline = time.monotonic() + timeout_s
    while True:
        job: dict[str, Any] = http.get(f"/v1/videos/{job_id}").json()
        if job["status"] in ("completed", "failed", "cancelled") or time.monotonic() > deadline:
            return job
        time.sleep(0.2)


def test_bad_jobs_say_what_to_fix(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError, match="4\\*k\\+1 frames"):
        client.videos.create(**JOB, extra_body={**EXTRA, "num_frames": 10})
    with pytest.raises(openai.BadRequestError, match="multiple of"):
        client.videos.create(prompt="x", size="60x48")
    with pytest.raises(openai.NotFoundError):
        client.videos.retrieve("video_nope")
    slow = client.videos.create(**BIG_JOB, extra_body={**EXTRA, "num_inference_steps": 40})
    with pytest.raises(openai.ConflictError, match=r"queued|in_progress"):
        client.videos.download_content(slow.id)
    client.videos.delete(slow.id)  # cancelled at its next step, leaving the replica free


def test_a_job_whose_owner_dies_is_run_again_elsewhere(
    dp2: ServeProcess, client: openai.OpenAI
) -> None:
    """The owner's gang is killed mid-run; `serve` restarts it (a new boot id), and the
    router that placed the job runs it again on the other replica: same id, same seed,
    so the same file as a job that ran undisturbed."""
    long = {**EXTRA, "num_inference_steps": 60}
    job = client.videos.create(**BIG_JOB, extra_body=long)
    running = eventually(lambda: _running(client, job.id), 120, "the job to start")
    owner = _extra(running, "replica")
    for process in [
        dp2.replica_supervisor(owner),
        *dp2.replica_supervisor(owner).children(recursive=True),
    ]:
        process.send_signal(signal.SIGKILL)
    done = _poll(client, job.id, timeout_s=300)
    assert done.status == "completed", done
    assert _extra(done, "attempt") == 2 and _extra(done, "replica") != owner
    rerun = client.videos.download_content(job.id).read()
    calm = _poll(client, client.videos.create(**BIG_JOB, extra_body=long).id, timeout_s=300)
    assert client.videos.download_content(calm.id).read() == rerun
    dp2.wait_healthy(120)  # the killed replica came back


def _running(client: openai.OpenAI, job_id: str) -> Any:
    job = client.videos.retrieve(job_id)
    return job if job.status == "in_progress" and job.progress > 0 else None


def test_an_sp_replica_splits_each_video_and_makes_the_same_frames(
    tiny_video_model: Path, client: openai.OpenAI
) -> None:
    """`serve --sp 2`: one replica whose two ranks each hold half of every pass's
    frames x tokens (docs/worker.md); its video is the one-rank replicas' within
    rounding, and a size whose tokens per frame do not split is a 400 naming sizes
    that do."""
    with (
        ServeProcess(tiny_video_model, 1, "--sp", "2", timeout_s=300) as sp2,
        openai.OpenAI(base_url=f"{sp2.url}/v1", api_key="unused", max_retries=0) as split,
    ):
        with pytest.raises(openai.BadRequestError, match=r"sequence-parallel ranks .* e\.g\. "):
            split.videos.create(prompt="x", size="48x48")  # 3 x 3 patches a frame
        mine = _poll(split, split.videos.create(**JOB, extra_body=EXTRA).id)
        assert mine.status == "completed", mine
        got = np.stack(_frames(split.videos.download_content(mine.id).read()))
    theirs = _poll(client, client.videos.create(**JOB, extra_body=EXTRA).id)
    want = np.stack(_frames(client.videos.download_content(theirs.id).read()))
    assert got.shape == want.shape == (9, 48, 64, 3)
    gap = np.abs(got.astype(np.int16) - want.astype(np.int16))
    assert gap.mean() < 0.5 and gap.max() <= 8, (gap.mean(), gap.max())


def _poll(client: openai.OpenAI, job_id: str, timeout_s: float = 120.0) -> Any:
    deadline = time.monotonic() + timeout_s
    while True:
        job = client.videos.retrieve(job_id)
        if job.status in ("completed", "failed", "cancelled") or time.monotonic() > deadline:
            return job
        time.sleep(0.2)


def _extra(job: Any, name: str) -> Any:
    """One of dpserve's fields beyond OpenAI's Video (the client keeps them)."""
    return (job.model_extra or {})[name]
