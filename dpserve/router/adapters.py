"""Where a request's LoRA adapters are, as far as this router can tell (docs/lora.md).

A replica's pings say which adapters it holds (``AdapterReport.resident``), but a ping
lags: a request this router just sent for adapter X will have X loaded there before
the next request for X could run, and the ping answered while it queued does not say
so. :class:`AdapterTrail` keeps, per replica, the adapters of this router's requests
there that its last ping cannot show: those in flight, and those answered after that
ping was asked. Adapter-aware least work (dpserve/router/load.py) counts a replica's
missing adapters' load time on top of its work ahead.
"""

from __future__ import annotations

import statistics
from collections import Counter
from collections.abc import Iterable, Sequence
from typing import Final

from dpserve.contract.protocol import AdapterReport, LoraRef

# Seconds to load one adapter while no replica has measured a load: a diffusion LoRA's
# safetensors (tens of MB) read and applied, on the order of the time of a few steps.
DEFAULT_ADAPTER_LOAD_S: Final = 0.5
# How far past its in-flight cap a replica holding a request's adapters, or their
# home, may take it (dpserve/router/admission.py): at twice, the hot adapters' home
# filled up under load and they spilled into the churning cache (bench/lora_sim.py).
HOLDER_CAP_FACTOR: Final = 4


class AdapterTrail:
    """Adapters of this router's requests at one replica that its last ping may not show."""

    def __init__(self) -> None:
        self._inflight: Counter[str] = Counter()
        self._answered: dict[str, float] = {}  # name -> when a request with it was answered

    def sent(self, names: Iterable[str]) -> None:
        self._inflight.update(names)

    def answered(self, names: Iterable[str], now: float) -> None:
        for name in names:
            self._inflight[name] -= 1
            if self._inflight[name] <= 0:
                del self._inflight[name]
            self._answered[name] = now

    def pinged(self, asked_at: float) -> None:
        """A ping asked at ``asked_at`` was answered: what was answered before it asked
        is in its report (resident, or evicted since)."""
        self._answered = {n: t for n, t in self._answered.items() if t >= asked_at}

    def present(self, resident: Iterable[str]) -> set[str]:
        """The adapters the replica holds or will hold before our next request runs there."""
        return {*resident, *self._inflight, *self._answered}


def names_of(refs: Sequence[LoraRef] | None) -> tuple[str, ...]:
    return tuple(r.name for r in refs or ())


def adapters_key(refs: Sequence[LoraRef]) -> str:
    """One key for a set of adapters, whatever their order and scales: where they gather."""
    return "\x00".join(sorted(r.name for r in refs))


def missing(refs: Sequence[LoraRef] | None, present: set[str]) -> list[str]:
    """The request's adapters a replica lacks, in the request's order."""
    return [r.name for r in refs or () if r.name not in present]


def load_seconds(count: int, own: float | None, others: Iterable[float | None]) -> float:
    """Seconds to load ``count`` adapters on a replica: its measured seconds per load,
    else the median of the other replicas' (the same model and hardware), else
    :data:`DEFAULT_ADAPTER_LOAD_S`."""
    if count <= 0:
        return 0.0
    if own is None:
        known = [s for s in others if s is not None]
        own = statistics.median(known) if known else DEFAULT_ADAPTER_LOAD_S
    return count * own


def evicts(report: AdapterReport | None) -> bool:
    """Whether one more adapter there must evict one: less room left than the adapters
    it holds take on average (the router does not know the new one's size)."""
    if report is None or not report.resident or report.capacity_bytes <= 0:
        return False
    average = report.used_bytes / len(report.resident)
    return report.capacity_bytes - report.used_bytes < average


def cache_slots(report: AdapterReport | None) -> int | None:
    """How many adapters the replica's cache holds, at the size of those it holds;
    None until it holds one (or has no cache)."""
    if report is None or not report.resident or report.capacity_bytes <= 0:
        return None
    average = report.used_bytes / len(report.resident)
    return max(1, int(report.capacity_bytes // average)) if average > 0 else None


def miss_seconds(load_s: float, evicting: bool) -> float:
    """What loading adapters costs the fleet: the load, and where the cache is full,
    once more for the adapter it evicts. **Decision:** with more adapters in demand
    than a cache holds, an evicted adapter is in demand too, so its next use there
    loads it again; counting only the load spreads one adapter over every replica's
    cache whenever waiting for its holder costs more than one load (docs/lora.md)."""
    return 2 * load_s if evicting else load_s
