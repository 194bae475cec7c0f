"""Each replica's LoRA adapter cache in the router's /metrics (docs/lora.md, Seeing it).

The replicas count from their boot and report the counts in their pings
(``AdapterReport``); the router shows them as they are, per replica, read from the
pool at scrape time: a counter that restarts with its replica, as Prometheus expects of
a process's counters. A replica without the cache is left out.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from dpserve.contract.protocol import AdapterReport
from dpserve.router.replica import Replica

# (metric name without _total, help, the report's field)
_COUNTERS = (
    ("dpserve_lora_cache_hits", "Requests' adapters found resident, per replica", "hits"),
    ("dpserve_lora_cache_misses", "Requests' adapters not resident, per replica", "misses"),
    ("dpserve_lora_cache_loads", "Adapters loaded into the cache, per replica", "loads"),
    ("dpserve_lora_cache_evictions", "Adapters evicted from the cache, per replica", "evictions"),
    (
        "dpserve_lora_cache_failures",
        "Adapters refused or failed to load, per replica",
        "failures",
    ),
    (
        "dpserve_lora_cache_load_seconds",
        "Seconds spent loading adapters, per replica",
        "load_seconds",
    ),
)


class LoraCacheCollector(Collector):
    """The replicas' cache reports as metric families, read from ``replicas`` at scrape."""

    def __init__(self, replicas: Callable[[], Iterable[Replica]]) -> None:
        self._replicas = replicas

    def collect(self) -> Iterator[Metric]:
        reports: list[tuple[str, AdapterReport]] = [
            (r.endpoint, r.adapters) for r in self._replicas() if r.adapters is not None
        ]
        for name, doc, attr in _COUNTERS:
            counter = CounterMetricFamily(name, doc, labels=["replica"])
            for replica, report in reports:
                counter.add_metric([replica], float(getattr(report, attr)))
            yield counter
        resident = GaugeMetricFamily(
            "dpserve_lora_cache_resident",
            "Adapters resident in each replica's cache (as of its last ping)",
            labels=["replica"],
        )
        used = GaugeMetricFamily(
            "dpserve_lora_cache_used_bytes",
            "Bytes each replica's adapter cache holds (as of its last ping)",
            labels=["replica"],
        )
        for replica, report in reports:
            resident.add_metric([replica], len(report.resident))
            used.add_metric([replica], report.used_bytes)
        yield resident
        yield used
