"""The model cache: plans, digests, one fill per entry under a lock, atomic publication,
resume, pruning, progress (dpserve/sources/{plan,digest,cache,progress}.py). A fill here
copies from a local folder; the real stores' fills are tested in tests/storage and
tests/hub."""

from __future__ import annotations

import hashlib
import json
import shutil
import threading
from pathlib import Path

import pytest

from dpserve.sources.cache import Filler, ModelCache
from dpserve.sources.digest import compute, verify
from dpserve.sources.errors import DigestMismatch
from dpserve.sources.plan import Digest, Plan, PlannedFile, human_bytes, listing_revision
from dpserve.sources.progress import JsonFileSink, Meter, Snapshot
from tests.polling import eventually


def _plan_of(folder: Path, source: str = "s3://models/x/") -> Plan:
    files = tuple(
        PlannedFile(
            str(p.relative_to(folder)),
            p.stat().st_size,
            Digest("sha256", hashlib.sha256(p.read_bytes()).hexdigest()),
        )
        for p in sorted(folder.rglob("*"))
        if p.is_file()
    )
    tags = {f.path: (f.size, f.digest.value) for f in files}
    return Plan(source, listing_revision(tags), files)


@pytest.fixture
def folder(tmp_path: Path) -> Path:
    src = tmp_path / "src"
    (src / "unet").mkdir(parents=True)
    (src / "model_index.json").write_text('{"_class_name": "X"}')
    (src / "unet" / "w.safetensors").write_bytes(bytes(range(256)) * 1000)
    return src


def _copier(src: Path, calls: list[int]) -> Filler:
    def fill(plan: Plan, staging: Path) -> Path:
        calls.append(1)
        for f in plan.files:
            out = staging / "model" / f.path
            out.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(src / f.path, out)
            verify(out, f, plan.source)
        return Path("model")

    return fill


def test_a_fill_publishes_a_whole_entry_with_its_record(folder: Path, tmp_path: Path) -> None:
    cache = ModelCache(tmp_path / "cache")
    plan = _plan_of(folder)
    entry = cache.entry("s3--models-x", plan)
    assert cache.ready(entry) is None
    calls: list[int] = []
    got = cache.fill(entry, plan, _copier(folder, calls))
    assert got == entry.dir / "model" and (got / "unet" / "w.safetensors").is_file()
    record = json.loads((entry.dir / "entry.json").read_text())
    assert record["revision"] == plan.revision and record["total_bytes"] == plan.total_bytes
    assert record["folder"] == f"entries/s3--models-x/{plan.revision}/model"
    assert {f["path"] for f in record["files"]} == {"model_index.json", "unet/w.safetensors"}
    assert not entry.staging.exists()
    # A second fill of the same entry reuses it.
    assert cache.fill(entry, plan, _copier(folder, calls)) == got
    assert calls == [1]


def test_concurrent_fillers_fill_once(folder: Path, tmp_path: Path) -> None:
    cache = ModelCache(tmp_path / "cache")
    plan = _plan_of(folder)
    entry = cache.entry("s3--models-x", plan)
    calls: list[int] = []
    gate = threading.Event()
    copy = _copier(folder, calls)

    def slow(plan: Plan, staging: Path) -> Path:
        gate.wait(10)
        return copy(plan, staging)

    results: list[Path] = []
    threads = [
        threading.Thread(target=lambda: results.append(cache.fill(entry, plan, slow)))
        for _ in range(3)
    ]
    for t in threads:
        t.start()
    eventually(lambda: entry.lock.read_text().strip(), 10, "a filler holds the lock")
    gate.set()
    for t in threads:
        t.join(10)
    assert calls == [1] and len(set(results)) == 1 and len(results) == 3


def test_a_failed_fill_publishes_nothing_and_the_next_resumes(folder: Path, tmp_path: Path) -> None:
    cache = ModelCache(tmp_path / "cache")
    plan = _plan_of(folder)
    entry = cache.entry("s3--models-x", plan)

    def half(plan: Plan, staging: Path) -> Path:
        (staging / "model").mkdir()
        shutil.copyfile(folder / "model_index.json", staging / "model" / "model_index.json")
        raise RuntimeError("killed")

    with pytest.raises(RuntimeError):
        cache.fill(entry, plan, half)
    assert cache.ready(entry) is None and not entry.dir.exists()
    assert (entry.staging / "model" / "model_index.json").is_file()  # kept for the next

    def rest(plan: Plan, staging: Path) -> Path:
        assert (staging / "model" / "model_index.json").is_file()
        return _copier(folder, [])(plan, staging)

    assert cache.fill(entry, plan, rest) == entry.dir / "model"


def test_pruning_keeps_the_newest_and_those_in_use(folder: Path, tmp_path: Path) -> None:
    cache = ModelCache(tmp_path / "cache")
    revisions = []
    for i in range(4):
        (folder / "model_index.json").write_text(json.dumps({"_class_name": "X", "v": i}))
        plan = _plan_of(folder)
        cache.fill(cache.entry("src", plan), plan, _copier(folder, []))
        revisions.append(plan.revision)
    removed = cache.prune("src", keep=2, protect=frozenset({revisions[0]}))
    assert [e.revision for e in removed] == [revisions[1]]
    assert not removed[0].dir.exists() and not removed[0].progress.exists()
    kept = [e.revision for e, _ in cache.entries("src")]
    assert kept == [revisions[3], revisions[2], revisions[0]]


def test_prune_cache_keeps_what_is_loaded_the_newest_others_and_fills_under_way(
    folder: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``dpserve prune-cache``, what a roll's clean-up Job runs: over every source."""
    import fcntl

    from dpserve.cli import main

    cache = ModelCache(tmp_path / "cache")
    made = []
    for i, source in enumerate(["s3://m/v1/", "s3://m/v2/", "s3://m/v3/", "s3://m/v4/"]):
        (folder / "model_index.json").write_text(json.dumps({"_class_name": "X", "v": i}))
        plan = _plan_of(folder, source)
        entry = cache.entry(source.replace("/", "-"), plan)
        made.append((entry, cache.fill(entry, plan, _copier(folder, []))))
    (v1, v1_folder), (v2, _), (v3, _), (v4, v4_folder) = made
    root = str(cache.root)
    with v2.lock.open("a+") as held:  # a fetch of v2's entry under way elsewhere
        fcntl.flock(held, fcntl.LOCK_EX)
        args = ["prune-cache", "--model-cache", root, "--keep", "1", "--protect", str(v1_folder)]
        assert main([*args, "--protect", str(v4_folder)]) == 0
    # Loaded: v1 and v4 (protected). The newest other, v3, is kept to roll back to;
    # v2 is locked. Nothing is removed.
    assert capsys.readouterr().out == ""
    assert (
        main(["prune-cache", "--model-cache", root, "--keep", "0", "--protect", str(v4_folder)])
        == 0
    )
    removed = capsys.readouterr().out.splitlines()
    assert sorted(removed) == sorted(
        f"removed s3://m/{v}/@{e.revision}" for v, e in (("v1", v1), ("v2", v2), ("v3", v3))
    )
    assert [e.revision for e, _ in cache.entries()] == [v4.revision]
    assert (v4_folder / "model_index.json").is_file()
    with pytest.raises(SystemExit):
        main(["prune-cache", "--model-cache", root, "--keep", "-1"])


def test_digests(tmp_path: Path) -> None:
    data = bytes(range(256)) * 40000  # 10 MB
    path = tmp_path / "f"
    path.write_bytes(data)
    assert compute(path, Digest("sha256", "")) == hashlib.sha256(data).hexdigest()
    assert compute(path, Digest("md5", "")) == hashlib.md5(data).hexdigest()
    git = hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()
    assert compute(path, Digest("git-sha1", "")) == git
    part = 5 << 20  # as an S3 multipart upload with 5 MiB parts computes its ETag
    md5s = [hashlib.md5(data[i : i + part]).digest() for i in range(0, len(data), part)]
    expected = f"{hashlib.md5(b''.join(md5s)).hexdigest()}-{len(md5s)}"
    assert compute(path, Digest("md5-parts", "", part)) == expected == expected[:-1] + "2"


def test_a_mismatch_deletes_the_file_and_names_it(tmp_path: Path) -> None:
    path = tmp_path / "w.safetensors"
    path.write_bytes(b"garbage")
    planned = PlannedFile("unet/w.safetensors", 7, Digest("sha256", "0" * 64))
    with pytest.raises(DigestMismatch) as refused:
        verify(path, planned, "s3://models/x/")
    assert not path.exists()
    message = str(refused.value)
    assert "unet/w.safetensors from s3://models/x/ is corrupt" in message
    assert "sha256:" + "0" * 64 in message and hashlib.sha256(b"garbage").hexdigest() in message


def test_a_plan_round_trips_as_json_and_says_its_total() -> None:
    plan = Plan(
        "s3://m/x/",
        "listing-1",
        (
            PlannedFile("a.json", 10, Digest("md5", "a" * 32)),
            PlannedFile("b.safetensors", 3 * 10**9, Digest("md5-parts", "b" * 32 + "-3", 10**9)),
        ),
    )
    assert Plan.from_json(json.loads(json.dumps(plan.to_json()))) == plan
    assert plan.summary() == "s3://m/x/ at listing-1: 2 files, 3.0 GB (3000000010 bytes)"
    assert human_bytes(999) == "999 B" and human_bytes(1500) == "1.5 KB"


def test_progress_math_and_its_file(tmp_path: Path) -> None:
    snap = Snapshot("s3://m/x/", "r", "fetching", 1000, 400, 300, 3.0)
    assert snap.fraction == 0.4 and snap.rate == 100.0 and snap.eta_s == 6.0
    assert snap.line() == "40% (400 B of 1.0 KB), 100 B/s, 0m06s left"
    assert Snapshot("s", "r", "fetching", 10, 0, 0, 0.0).eta_s is None
    path = tmp_path / "p.json"
    meter = Meter("s3://m/x/", "r", 1000, [JsonFileSink(path)], every_s=0.0)
    meter.add(600, 100)
    assert json.loads(path.read_text())["bytes_done"] == 600
    meter.finish()
    final = json.loads(path.read_text())
    assert final["state"] == "ready" and final["bytes_moved"] == 100 and final["eta_s"] == 0.0


@pytest.mark.parametrize(
    "digest", [Digest("sha256", ""), Digest("git-sha1", ""), Digest("md5-parts", "", 1000)]
)
def test_hashing_while_writing_in_any_pieces_equals_hashing_the_file(
    digest: Digest, tmp_path: Path
) -> None:
    from dpserve.sources.digest import Hasher

    data = bytes(range(256)) * 20  # 5120 bytes: five whole parts and a short one
    path = tmp_path / "f"
    path.write_bytes(data)
    streamed = Hasher(digest, len(data))
    for start in range(0, len(data), 777):  # pieces that straddle part boundaries
        streamed.update(data[start : start + 777])
    assert streamed.hexdigest() == compute(path, digest)
    exact = Hasher(Digest("md5-parts", "", 1024), 4096)
    exact.update(data[:4096])
    assert exact.hexdigest().endswith("-4")  # a whole last part is not counted twice


def test_the_terminal_bar() -> None:
    import io

    from dpserve.sources.progress import BarSink

    out = io.StringIO()
    bar = BarSink(out, width=10)
    bar.show(Snapshot("s", "r", "fetching", 1000, 400, 400, 2.0))
    bar.show(Snapshot("s", "r", "ready", 1000, 1000, 1000, 4.0))
    assert out.getvalue() == (
        "\r[####......] 40% (400 B of 1.0 KB), 200 B/s, 0m03s left\x1b[K"
        "\r[##########] 100% (1.0 KB of 1.0 KB), 250 B/s\x1b[K\n"
    )


def test_the_log_lines(caplog: pytest.LogCaptureFixture) -> None:
    import logging

    from dpserve.sources.progress import LogSink

    log = logging.getLogger("test.sources")
    sink = LogSink(log, every_s=0.0)
    with caplog.at_level(logging.INFO, logger="test.sources"):
        sink.show(Snapshot("s3://m/x/", "r", "fetching", 4000, 1000, 1000, 1.0))
        sink.show(Snapshot("s3://m/x/", "r", "ready", 4000, 4000, 3000, 2.0))
        sink.show(Snapshot("s3://m/x/", "r", "failed", 4000, 10, 10, 2.0, "x is corrupt"))
    assert caplog.messages == [
        "fetching s3://m/x/: 25% (1.0 KB of 4.0 KB), 1.0 KB/s, 0m03s left",
        "fetched s3://m/x/: 4.0 KB in 2.0s (3.0 KB moved, 1.5 KB/s)",
        "fetching s3://m/x/ failed: x is corrupt",
    ]
