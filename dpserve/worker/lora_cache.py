"""A replica's adapter cache: which request adapters stay loaded, and what to evict.

The bookkeeping only (torch-free, so it is tested on its own); the loading is
``worker/lora_request.py``'s. Every rank of a gang keeps one and feeds it the same
events in the same order, with sizes every rank computes alike (the adapter's files,
not a tensor-parallel piece of it), so every rank evicts the same adapters.

It is kept apart from the control state: that is the service's desired state, this
is what one replica happens to hold. The service's own adapters (``set_lora``) are
not entries here: they are reported as pinned and never evicted.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Collection, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Final

from dpserve.contract.protocol import AdapterReport

# peft keeps adapters in ``nn.ModuleDict``s (no '.' in a key): a request adapter's
# internal name swaps '.' for '~', which a request name cannot hold, behind a prefix
# no request name has either, so it never clashes with a name or a service nickname.
INTERNAL_PREFIX: Final = "req~"
# A running mean of load times: the newest load weighs this much.
LOAD_WEIGHT: Final = 0.3


def internal_name(name: str) -> str:
    return INTERNAL_PREFIX + name.replace(".", "~")


def folder_bytes(folder: Path) -> int:
    """An adapter's size as every rank computes it: its safetensors files' bytes."""
    return sum(f.stat().st_size for f in folder.iterdir() if f.suffix == ".safetensors")


@dataclass
class Entry:
    path: str  # the real folder it was loaded from
    size: int


@dataclass
class AdapterCache:
    capacity: int  # bytes (--lora-cache-mb)
    entries: OrderedDict[str, Entry] = field(default_factory=OrderedDict)  # LRU first
    known: dict[str, str] = field(default_factory=dict)  # name -> path, bound at first load
    hits: int = 0
    misses: int = 0
    loads: int = 0
    evictions: int = 0
    failures: int = 0
    load_seconds: float = 0.0
    load_s: float | None = None  # running mean of one load's seconds
    evict_seconds: float = 0.0

    @property
    def swap_seconds(self) -> float:
        """Seconds spent changing what is resident (loads and evictions), in all: a
        generation's calibration leaves them out (executor.py)."""
        return self.load_seconds + self.evict_seconds

    @property
    def used(self) -> int:
        return sum(e.size for e in self.entries.values())

    def touch(self, name: str) -> bool:
        """A request uses ``name``: True (a hit, now most recent) when resident."""
        if name in self.entries:
            self.entries.move_to_end(name)
            self.hits += 1
            return True
        self.misses += 1
        return False

    def fits(self, size: int) -> bool:
        return size <= self.capacity

    def loaded(self, name: str, path: str, size: int, seconds: float) -> None:
        """``name`` is resident now (most recent), bound to ``path`` for good."""
        self.entries[name] = Entry(path, size)
        self.entries.move_to_end(name)
        self.known.setdefault(name, path)
        self.loads += 1
        self.load_seconds += seconds
        mean = self.load_s
        self.load_s = seconds if mean is None else mean + LOAD_WEIGHT * (seconds - mean)

    def victims(self, in_use: Collection[str]) -> list[str]:
        """Least recently used first, until what stays fits; never one in use."""
        over = self.used - self.capacity
        out = []
        for name, entry in self.entries.items():
            if over <= 0:
                break
            if name not in in_use:
                out.append(name)
                over -= entry.size
        return out

    def evicted(self, name: str, seconds: float = 0.0) -> None:
        del self.entries[name]
        self.evictions += 1
        self.evict_seconds += seconds

    def forget(self, names: Iterable[str]) -> None:
        """These are gone from the pipeline without an eviction (a weight reload dropped
        every adapter); their names stay bound."""
        for name in list(names):
            self.entries.pop(name, None)

    def report(self, pinned: dict[str, str]) -> AdapterReport:
        """The ping's view; ``pinned`` the service's adapters (nickname -> path)."""
        return AdapterReport(
            resident=sorted({*self.entries, *pinned}),
            pinned=sorted(pinned),
            known={**self.known, **pinned},
            capacity_bytes=self.capacity,
            used_bytes=self.used,
            load_s=self.load_s,
            hits=self.hits,
            misses=self.misses,
            loads=self.loads,
            evictions=self.evictions,
            failures=self.failures,
            load_seconds=round(self.load_seconds, 6),
        )
