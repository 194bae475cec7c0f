"""Realtime session state on a real replica: frames, determinism, limits, expiry, CFG gangs."""

from __future__ import annotations

import io
from collections.abc import Iterator
from pathlib import Path

import msgspec
import numpy as np
import pytest
from PIL import Image

from dpserve.client import ReplicaClient
from dpserve.contract import protocol as p
from dpserve.contract import realtime as rt
from tests.polling import eventually
from tests.workers import WorkerProcess

pytestmark = pytest.mark.gang

PARAMS = rt.SessionParams(prompt="a red fox", width=64, height=64, num_inference_steps=4, seed=11)
CFG_PARAMS = rt.SessionParams(
    prompt="a red fox",
    negative_prompt="blurry",
    true_cfg_scale=4.0,
    width=64,
    height=64,
    num_inference_steps=4,
    seed=11,
)


@pytest.fixture(scope="module")
def worker(tiny_model: Path, allow_tmp: tuple[str, str]) -> Iterator[WorkerProcess]:
    args = ("--max-sessions", "3", "--session-idle-timeout", "3", "--max-session-mb", "0.01")
    with WorkerProcess(tiny_model, *args, *allow_tmp) as proc:
        yield proc


@pytest.fixture()
def client(worker: WorkerProcess) -> Iterator[ReplicaClient]:
    with worker.client() as c:
        yield c
        for n in range(8):  # leave no session behind for the next test
            c.session(rt.SessionRequest(action="close", session_id=f"s{n}"))


def _open(c: ReplicaClient, sid: str, params: rt.SessionParams = PARAMS) -> bytes:
    frame, blobs = c.session(rt.SessionRequest(action="open", session_id=sid, params=params))
    assert frame.index == 0 and frame.session_id == sid
    return blobs[0]


def _step(c: ReplicaClient, sid: str, prompt: str | None = None, epoch: int | None = None) -> bytes:
    _frame, blobs = c.session(
        rt.SessionRequest(action="step", session_id=sid, prompt=prompt, epoch=epoch)
    )
    return blobs[0]


def _pixels(png: bytes) -> np.ndarray:
    return np.asarray(Image.open(io.BytesIO(png)).convert("RGB"), dtype=np.float64)


def test_first_frame_is_the_plain_generation_of_the_seed(client: ReplicaClient) -> None:
    first = _open(client, "s0")
    _result, images = client.generate(
        prompt="a red fox", width=64, height=64, num_inference_steps=4, seed=11
    )
    assert first == images[0]


def test_frames_evolve_from_the_session_state_and_are_reproducible(client: ReplicaClient) -> None:
    runs = []
    for sid in ("s0", "s1"):
        frames = [_open(client, sid)]
        frames += [_step(client, sid) for _ in range(3)]
        frames.append(_step(client, sid, prompt="a blue whale"))
        runs.append(frames)
    assert runs[0] == runs[1]  # same seed, same prompts: the same frames, byte for byte
    frames = runs[0]
    assert len(set(frames)) == len(frames)  # every frame moves on


def test_strength_sets_how_far_a_frame_moves_from_the_last(client: ReplicaClient) -> None:
    """The previous latents really seed the next frame: the less they are re-noised,
    the closer the next frame stays (and an unrelated seed is farther than either)."""
    moved = {}
    for n, strength in enumerate((0.1, 0.9)):
        sid = f"s{n}"
        first = _open(client, sid, _with(PARAMS, strength=strength))
        moved[strength] = np.abs(_pixels(_step(client, sid)) - _pixels(first)).mean()
    other = _open(client, "s2", _with(PARAMS, seed=999))
    unrelated = np.abs(_pixels(other) - _pixels(first)).mean()
    assert moved[0.1] < moved[0.9] / 2 < unrelated, (moved, unrelated)


def _with(params: rt.SessionParams, **changes: object) -> rt.SessionParams:
    return msgspec.structs.replace(params, **changes)


def test_limits_sessions_and_memory(client: ReplicaClient) -> None:
    for n in range(3):
        _open(client, f"s{n}")
    with pytest.raises(p.RequestError) as exc:
        _open(client, "s3")
    assert exc.value.code == p.OVERLOADED and "maximum of 3 sessions" in str(exc.value)
    ping = client.ping()
    assert (ping.sessions, ping.max_sessions, ping.session_bytes) == (3, 3, 3 * 1024)
    client.session(rt.SessionRequest(action="close", session_id="s0"))
    # The tiny model's state is 64 bytes per 16x16 patch: 1 KiB at 64 px, 16 KiB at 256 px,
    # over the worker's 0.01 MiB limit.
    big = _with(PARAMS, width=256, height=256)
    with pytest.raises(p.RequestError) as exc:
        _open(client, "s4", big)
    assert exc.value.code == p.OVERLOADED and "over the replica's limit" in str(exc.value)
    assert client.ping().sessions == 2


def test_close_releases_and_unknown_sessions_are_not_found(client: ReplicaClient) -> None:
    _open(client, "s0")
    info, _ = client.session(rt.SessionRequest(action="close", session_id="s0"))
    assert info.released and info.frames == 1
    info, _ = client.session(rt.SessionRequest(action="close", session_id="s0"))
    assert not info.released
    with pytest.raises(p.RequestError) as exc:
        _step(client, "s0")
    assert exc.value.code == p.NOT_FOUND and "closed, expired" in str(exc.value)
    assert client.ping().sessions == 0


def test_resume_takes_over_and_the_old_epoch_is_refused(client: ReplicaClient) -> None:
    _open(client, "s0")
    info, _ = client.session(rt.SessionRequest(action="resume", session_id="s0"))
    assert info.epoch == 1 and info.frames == 1
    with pytest.raises(p.RequestError) as exc:
        _step(client, "s0", epoch=0)
    assert exc.value.code == p.CONFLICT and "resumed by another connection" in str(exc.value)
    assert _step(client, "s0", epoch=1).startswith(b"\x89PNG")
    # The connection that was taken over cannot release the session either.
    stale = rt.SessionRequest(action="close", session_id="s0", epoch=0)
    info, _ = client.session(stale)
    assert not info.released and client.ping().sessions == 1


def test_released_weights_pause_frames_without_changing_them(client: ReplicaClient) -> None:
    _open(client, "s0")
    _open(client, "s1")
    expected = _step(client, "s0", prompt="a lantern")
    cfg = msgspec.structs.asdict(CFG_PARAMS)
    for key in ("frame_steps", "strength"):
        cfg.pop(key)
    before = client.generate(**cfg)[1]
    client.control("release_memory_occupation")
    try:
        with pytest.raises(p.RequestError) as exc:
            _step(client, "s1", prompt="a lantern")
        assert exc.value.code == p.UNAVAILABLE
    finally:
        client.control("resume_memory_occupation")
    assert client.ping().sessions == 2  # the state outlived the release
    assert _step(client, "s1", prompt="a lantern") == expected
    # Resumed weights compute bit for bit as before (true CFG amplifies any difference).
    assert client.generate(**cfg)[1] == before


def test_idle_sessions_are_released(client: ReplicaClient) -> None:
    _open(client, "s0")
    _open(client, "s1")
    assert client.ping().sessions == 2
    eventually(lambda: client.ping().sessions == 0, timeout_s=15, what="an idle release")
    with pytest.raises(p.RequestError, match="expired after 3s idle"):
        _step(client, "s0")


def test_a_first_frame_starts_the_session(client: ReplicaClient) -> None:
    def from_image(sid: str, colour: tuple[int, int, int]) -> bytes:
        buf = io.BytesIO()
        Image.new("RGB", (64, 64), colour).save(buf, format="PNG")
        request = rt.SessionRequest(action="open", session_id=sid, params=PARAMS, first_frame=0)
        frame, blobs = client.session(request, [buf.getvalue()])
        assert frame.index == 0
        return blobs[0]

    red = from_image("s0", (250, 20, 20))
    # The image drives the frame: another image, or none, renders another one.
    assert red != from_image("s1", (20, 20, 250)) and red != _open(client, "s2")
    for sid in ("s1", "s2"):
        client.session(rt.SessionRequest(action="close", session_id=sid))
    # Without a size, frames take the image's (down to the model's multiple of 16).
    buf = io.BytesIO()
    Image.new("RGB", (100, 70), (20, 20, 250)).save(buf, format="PNG")
    sized = rt.SessionRequest(
        action="open", session_id="s3", params=_with(PARAMS, width=None, height=None), first_frame=0
    )
    frame, _ = client.session(sized, [buf.getvalue()])
    assert (frame.width, frame.height) == (96, 64)
    assert _pixels(_step(client, "s3")).shape == (64, 96, 3)
    client.session(rt.SessionRequest(action="close", session_id="s3"))
    bad = rt.SessionRequest(action="open", session_id="s2", params=PARAMS, first_frame=0)
    with pytest.raises(p.RequestError, match="not a readable image"):
        client.session(bad, [b"not an image"])
    with pytest.raises(p.RequestError, match="blob the message lacks"):
        client.session(bad)
    huge = io.BytesIO()
    Image.new("L", (5000, 4000)).save(huge, format="PNG")  # a few KiB, 20 Mpx decoded
    with pytest.raises(p.RequestError, match="at most 4096x4096 pixels"):
        client.session(bad, [huge.getvalue()])
    assert client.ping().sessions == 1


def test_a_weight_update_reaches_sessions_started_from_an_image(
    client: ReplicaClient, tiny_model: Path, tiny_model_b: Path
) -> None:
    buf = io.BytesIO()
    Image.new("RGB", (64, 64), (30, 160, 90)).save(buf, format="PNG")

    def open_from_image(sid: str) -> bytes:
        request = rt.SessionRequest(action="open", session_id=sid, params=PARAMS, first_frame=0)
        frame_bytes = client.session(request, [buf.getvalue()])[1][0]
        client.session(rt.SessionRequest(action="close", session_id=sid))
        return frame_bytes

    before = open_from_image("s0")
    client.control("update_weights_from_disk", model_path=str(tiny_model_b))
    try:
        assert open_from_image("s1") != before  # rendered by the new transformer
    finally:
        client.control("update_weights_from_disk", model_path=str(tiny_model))
    assert open_from_image("s2") == before


def test_malformed_session_messages_leave_the_replica_serving(client: ReplicaClient) -> None:
    for body, needle in (
        ({"action": "jump", "session_id": "s0"}, "unknown session action"),
        ({"action": "open", "session_id": "s0"}, "needs the session's params"),
        ({"action": "step"}, "invalid session body"),
        ({"action": "open", "session_id": "s0", "params": {"prompt": "x", "width": 50}}, "width"),
    ):
        with pytest.raises(p.RequestError, match=needle):
            client.call(p.SESSION, body)
    assert _open(client, "s0").startswith(b"\x89PNG")


def test_cfg_gang_renders_the_same_frames(tiny_model: Path, client: ReplicaClient) -> None:
    """Both ranks of a CFG-parallel gang hold the session; the frames equal one rank's."""
    single = [_open(client, "s0", CFG_PARAMS), _step(client, "s0"), _step(client, "s0", "a cat")]
    with WorkerProcess(tiny_model, "--cfg", "2") as gang, gang.client() as c:
        paired = [_open(c, "g", CFG_PARAMS), _step(c, "g"), _step(c, "g", "a cat")]
        assert c.ping().sessions == 1
        info = c.control("model_info")
    assert info["cfg_parallel"] == "split" and info["realtime"] == "supported"
    assert paired == single
