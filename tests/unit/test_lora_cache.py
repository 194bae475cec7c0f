"""The adapter cache's bookkeeping (LRU by bytes, pins, counters, the ping's report) and
the driver's read-ahead of adapter files: torch-free parts, tested on their own."""

from __future__ import annotations

from pathlib import Path

from dpserve.contract.protocol import AdapterReport, GenerateParams, LoraRef
from dpserve.worker.batch import compatible
from dpserve.worker.driver.read_ahead import ReadAhead, missing
from dpserve.worker.lora_cache import AdapterCache, folder_bytes, internal_name
from dpserve.worker.paths import AllowedPaths
from tests.polling import eventually


def _filled(capacity: int, *sizes: int) -> AdapterCache:
    cache = AdapterCache(capacity)
    for i, size in enumerate(sizes):
        assert not cache.touch(f"a{i}")
        cache.loaded(f"a{i}", f"/l/{i}", size, 0.1 * (i + 1))
    return cache


def test_least_recently_used_go_first_until_the_rest_fits() -> None:
    cache = _filled(100, 40, 40)
    assert cache.victims(in_use=set()) == []  # 80 of 100: nothing to do
    assert cache.touch("a0")  # a1 is now the least recently used
    cache.loaded("a2", "/l/2", 40, 0.1)
    assert cache.used == 120
    assert cache.victims(in_use={"a2"}) == ["a1"]
    cache.evicted("a1")
    assert list(cache.entries) == ["a0", "a2"] and cache.used == 80


def test_adapters_in_use_are_never_evicted_even_over_the_bound() -> None:
    cache = _filled(100, 60, 60)
    assert cache.victims(in_use={"a0"}) == ["a1"]
    assert cache.victims(in_use={"a0", "a1"}) == []  # the running request needs both
    assert not cache.fits(101) and cache.fits(100)


def test_counters_and_the_running_mean_of_load_times() -> None:
    cache = _filled(1000, 10, 10)
    assert cache.touch("a0") and not cache.touch("zz")
    cache.failures += 1
    cache.evicted("a1")
    assert (cache.hits, cache.misses, cache.loads, cache.evictions) == (1, 3, 2, 1)
    assert abs(cache.load_seconds - 0.3) < 1e-9
    assert cache.load_s is not None and 0.1 < cache.load_s < 0.2  # moved toward 0.2


def test_names_stay_bound_after_eviction_and_reload() -> None:
    cache = _filled(100, 10)
    cache.evicted("a0")
    cache.forget(["nothing"])
    assert cache.known == {"a0": "/l/0"} and not cache.entries


def test_the_report_lists_pinned_service_adapters_as_resident() -> None:
    cache = _filled(100, 10)
    report = cache.report({"svc": "/s"})
    assert report.resident == ["a0", "svc"] and report.pinned == ["svc"]
    assert report.known == {"a0": "/l/0", "svc": "/s"}
    assert (report.capacity_bytes, report.used_bytes, report.loads) == (100, 10, 1)


def test_internal_names_hold_no_dot_and_never_clash() -> None:
    assert internal_name("a.b") != internal_name("a-b")
    assert "." not in internal_name("x.y.z") and internal_name("svc") != "svc"


def test_batches_join_only_requests_with_the_same_adapters_and_scales() -> None:
    def params(lora: list[LoraRef] | None) -> GenerateParams:
        return GenerateParams(prompt="p", seed=[1], lora=lora)

    ink = LoraRef(name="ink", path="/l/ink", scale=0.5)
    assert compatible(params([ink]), params([ink]))
    assert not compatible(params([ink]), params(None))
    assert not compatible(params([ink]), params([]))
    assert not compatible(params([ink]), params([LoraRef(name="ink", path="/l/ink", scale=0.6)]))
    wash = LoraRef(name="wash", path="/l/w")
    assert not compatible(params([ink, wash]), params([wash, ink]))  # the stacking order


def test_read_ahead_reads_only_what_the_gang_lacks_inside_allowed_folders(
    tmp_path: Path,
) -> None:
    root = tmp_path / "root"
    held, wanted, outside = root / "held", root / "wanted", tmp_path / "outside"
    for folder in (held, wanted, outside):
        folder.mkdir(parents=True)
        (folder / "pytorch_lora_weights.safetensors").write_bytes(b"x" * 1000)
        (folder / "notes.txt").write_text("not an adapter file")
    assert folder_bytes(wanted) == 1000
    report = AdapterReport(resident=["held"], known={"held": str(held), "w": str(wanted)})
    refs = [LoraRef(name="held"), LoraRef(name="w"), LoraRef(name="new", path=str(outside))]
    assert missing(refs, report) == [str(wanted), str(outside)]
    assert missing([LoraRef(name="unknown")], report) == []
    reader = ReadAhead(AllowedPaths.of(root))
    reader.start()
    try:
        reader.want(refs, report)
        reader.want(refs, report)  # read recently: not again
        eventually(lambda: reader.folders == 1, timeout_s=10, poll_s=0.01)
        reader.want([LoraRef(name="w")], report)
    finally:
        reader.close()
    assert reader.folders == 1 and reader.read_bytes == 1000  # never the folder outside
