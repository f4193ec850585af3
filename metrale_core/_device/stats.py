"""The counters behind ``stats()``: `StatsCounter` counts, `MemoryStats` is what it reports.

Every part of one backend bumps the same counter; it imports nothing of theirs.
"""

from __future__ import annotations

import dataclasses
import threading
from typing import Final, final

__all__ = ["KINDS", "MemoryStats", "StatsCounter"]

#: The kinds of allocation that ``stats()`` counts bytes for.
KINDS: Final = ("device", "managed", "arena", "pool")


@final
@dataclasses.dataclass(frozen=True, slots=True)
class MemoryStats:
    """What a backend has allocated since it opened (peaks since the last ``reset_peak()``).

    :ivar alloc_count: allocations made: ``alloc``, ``alloc_managed``, ``alloc_arena``, ``MemoryPool.alloc``.
    :ivar free_count: allocations released: ``free``, ``free_arena``, ``MemoryPool.free``, and each one a sweep took.
    :ivar current_bytes: bytes live now, per kind (``"device"``, ``"managed"``, ``"arena"``, and ``"pool"``: the
        pieces of memory pools out now, not the bytes the pools cache).
    :ivar peak_bytes: the most bytes live at once, per kind.
    :ivar peak_total_bytes: the most bytes live at once, all kinds together.
    :ivar arena_capacity: bytes of the open [`Arena`][metrale_core.Arena] objects.
    :ivar arena_used: bytes those arenas have handed out since their last ``reset()``.
    :ivar arena_allocs: sub-allocations the arenas have made.
    :ivar oom_count: allocations that failed for lack of memory (after any retries).
    :ivar oom_retries: allocations tried again after an ``on_out_of_memory`` callback freed memory.
    :ivar redzone_scans: full red-zone scans (``scan_redzones()``, after graph launches, at ``close()``).
    :ivar graph_launches: ``GraphExec.launch`` calls.
    :ivar redzone_quarantined: freed zoned buffers waiting in quarantine (off the ledger and out of
        ``current_bytes``; their memory not released yet).
    :ivar redzone_quarantined_bytes: the device memory they hold, zones included.
    :ivar redzone_reusable: checked freed zoned blocks kept for the next allocation of their size
        (their zones found intact: a reuse needs no driver allocation, only the fill of its zones).
    :ivar redzone_reusable_bytes: the device memory they hold, zones included.
    :ivar redzone_sample: red zones go to one allocation in this many (``redzone_sample``).
    :ivar allocated_bytes: bytes allocated since the backend opened, per kind (every allocation counted,
        freed or not; ``reset_peak()`` leaves it).
    """

    alloc_count: int
    free_count: int
    current_bytes: dict[str, int]
    peak_bytes: dict[str, int]
    peak_total_bytes: int
    arena_capacity: int
    arena_used: int
    arena_allocs: int
    oom_count: int
    oom_retries: int
    redzone_scans: int
    graph_launches: int
    redzone_quarantined: int = 0
    redzone_quarantined_bytes: int = 0
    redzone_sample: int = 1
    redzone_reusable: int = 0
    redzone_reusable_bytes: int = 0
    allocated_bytes: dict[str, int] = dataclasses.field(default_factory=dict)

    @property
    def current_total_bytes(self) -> int:
        """Bytes live now, all kinds together."""
        return sum(self.current_bytes.values())


@final
class StatsCounter:
    """The mutable counters behind [`MemoryStats`][metrale_core.MemoryStats]. Thread-safe."""

    __slots__ = (
        "_allocated", "_current", "_lock", "_peak", "_peak_total", "_total", "allocs", "arena_allocs", "frees",
        "graph_launches",
        "oom_count", "oom_retries", "quarantined_bytes", "quarantined_count", "redzone_sample", "redzone_scans",
        "reusable_bytes", "reusable_count",
    )

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._current = dict.fromkeys(KINDS, 0)
        self._peak = dict.fromkeys(KINDS, 0)
        self._allocated = dict.fromkeys(KINDS, 0)
        self._peak_total = 0
        self._total = 0  # the sum of _current
        self.allocs = 0
        self.frees = 0
        # Plain integers bumped without the lock: a lost count under a race is harmless for a statistic,
        # and these sit on fast paths (arena alloc, graph launch).
        self.arena_allocs = 0
        self.oom_count = 0
        self.oom_retries = 0
        self.redzone_scans = 0
        self.graph_launches = 0
        self.quarantined_count = 0
        self.quarantined_bytes = 0
        self.reusable_count = 0
        self.reusable_bytes = 0
        self.redzone_sample = 1

    def quarantined(self, count: int, nbytes: int) -> None:
        """Buffers entered (positive) or left (negative) the red-zone quarantine."""
        with self._lock:
            self.quarantined_count += count
            self.quarantined_bytes += nbytes

    def reusable(self, count: int, nbytes: int) -> None:
        """Checked zoned blocks entered (positive) or left (negative) the red zones' reuse lists."""
        with self._lock:
            self.reusable_count += count
            self.reusable_bytes += nbytes

    def allocated(self, kind: str, nbytes: int) -> None:
        with self._lock:
            self.allocs += 1
            current = self._current
            now = current[kind] = current[kind] + nbytes
            self._peak[kind] = max(self._peak[kind], now)
            self._allocated[kind] += nbytes
            total = self._total = self._total + nbytes
            self._peak_total = max(self._peak_total, total)

    def released(self, kind: str, nbytes: int) -> None:
        with self._lock:
            self.frees += 1
            self._current[kind] -= nbytes
            self._total -= nbytes

    def reset_peak(self) -> None:
        with self._lock:
            self._peak = dict(self._current)
            self._peak_total = sum(self._current.values())

    def freeze(self, arena_capacity: int, arena_used: int, arena_allocs: int) -> MemoryStats:
        """The counters now, with what the open arenas hold (closed ones were counted as they closed)."""
        with self._lock:
            return MemoryStats(
                alloc_count=self.allocs,
                free_count=self.frees,
                current_bytes=dict(self._current),
                peak_bytes=dict(self._peak),
                peak_total_bytes=self._peak_total,
                arena_capacity=arena_capacity,
                arena_used=arena_used,
                arena_allocs=self.arena_allocs + arena_allocs,
                oom_count=self.oom_count,
                oom_retries=self.oom_retries,
                redzone_scans=self.redzone_scans,
                graph_launches=self.graph_launches,
                redzone_quarantined=self.quarantined_count,
                redzone_quarantined_bytes=self.quarantined_bytes,
                redzone_sample=self.redzone_sample,
                redzone_reusable=self.reusable_count,
                redzone_reusable_bytes=self.reusable_bytes,
                allocated_bytes=dict(self._allocated),
            )
