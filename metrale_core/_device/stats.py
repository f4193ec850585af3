"""The counter behind ``stats()``: `StatsCounter` counts, `MemoryStats` (``memory_stats.py``) is what it reports.

Every part of one backend bumps the same counter; it imports nothing of theirs. Written once, here, and compiled as
well as run as Python (``_stats``, with ``_stats.pxd`` beside it: docs/building.md):

- its counters by kind are kept in `KINDS`'s order (a list as Python, C integers compiled), under its lock (the C
  lock of ``_lock.pxd`` compiled);
- the hot paths count with the kind's index at hand (`allocated_c`, `released_c`: ``allocated_c(KIND_DEVICE, n)``),
  the compiled ones at C level (``_stats.pxd``).
"""

from __future__ import annotations

from typing import Final

from .memory_stats import KINDS, MemoryStats

try:
    import cython
except ImportError:  # (no Cython here: this module runs as Python)
    from .. import _nocython as cython

if not cython.compiled:  # (compiled: the C lock of _lock.pxd, and the kinds' C constants of _stats.pxd)
    from ._lock import acquire_lock, new_lock, release_lock

    #: How many kinds of memory are counted, and the index of two of them in `KINDS` (the compiled lane's).
    N_KINDS: Final = len(KINDS)
    KIND_DEVICE: Final = KINDS.index("device")
    KIND_POOL: Final = KINDS.index("pool")

__all__ = ["KINDS", "KIND_DEVICE", "KIND_POOL", "MemoryStats", "StatsCounter"]

if len(KINDS) != N_KINDS or KINDS[KIND_DEVICE] != "device" or KINDS[KIND_POOL] != "pool":  # (compiled: the loader
    raise ImportError(  # falls back to the pure counter)
        f"the compiled stats counter counts {N_KINDS} kinds of memory, device first, pool last; KINDS is {KINDS}"
    )

#: Each kind's index in `KINDS`.
_INDEX: Final = {name: i for i, name in enumerate(KINDS)}


class StatsCounter:
    """The mutable counters behind [`MemoryStats`][metrale_core.MemoryStats]. Thread-safe."""

    __slots__ = (
        "_allocated", "_current", "_lock", "_peak", "_peak_total", "_total", "allocs", "arena_allocs", "frees",
        "graph_launches",
        "oom_count", "oom_retries", "quarantined_bytes", "quarantined_count", "redzone_sample", "redzone_scans",
        "reusable_bytes", "reusable_count",
    )

    def __init__(self) -> None:
        self._lock = new_lock()
        if not cython.compiled:  # (compiled: C arrays, zeroed with the object)
            # bytes by kind, in KINDS's order: live now, their peak, allocated since the backend opened
            self._current = [0] * N_KINDS
            self._peak = [0] * N_KINDS
            self._allocated = [0] * N_KINDS
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
        acquire_lock(self._lock)
        try:
            self.quarantined_count += count
            self.quarantined_bytes += nbytes
        finally:
            release_lock(self._lock)

    def reusable(self, count: int, nbytes: int) -> None:
        """Checked zoned blocks entered (positive) or left (negative) the red zones' reuse lists."""
        acquire_lock(self._lock)
        try:
            self.reusable_count += count
            self.reusable_bytes += nbytes
        finally:
            release_lock(self._lock)

    def allocated(self, kind: str, nbytes: int) -> None:
        self.allocated_c(_INDEX[kind], nbytes)

    def released(self, kind: str, nbytes: int) -> None:
        self.released_c(_INDEX[kind], nbytes)

    def allocated_c(self, k: int, nbytes: int) -> None:
        """`allocated`, the kind by its index in `KINDS`."""
        acquire_lock(self._lock)
        try:
            self.allocs += 1
            now = self._current[k] + nbytes
            self._current[k] = now
            self._peak[k] = max(self._peak[k], now)
            self._allocated[k] += nbytes
            self._total += nbytes
            self._peak_total = max(self._peak_total, self._total)
        finally:
            release_lock(self._lock)

    def released_c(self, k: int, nbytes: int) -> None:
        """`released`, the kind by its index in `KINDS`."""
        acquire_lock(self._lock)
        try:
            self.frees += 1
            self._current[k] -= nbytes
            self._total -= nbytes
        finally:
            release_lock(self._lock)

    def reset_peak(self) -> None:
        acquire_lock(self._lock)
        try:
            total = 0
            for k in range(N_KINDS):
                self._peak[k] = self._current[k]
                total += self._current[k]
            self._peak_total = total
        finally:
            release_lock(self._lock)

    def freeze(self, arena_capacity: int, arena_used: int, arena_allocs: int) -> MemoryStats:
        """The counters now, with what the open arenas hold (closed ones were counted as they closed)."""
        acquire_lock(self._lock)
        try:  # (read under the lock; the record is made after it)
            current = {KINDS[k]: self._current[k] for k in range(N_KINDS)}
            peak = {KINDS[k]: self._peak[k] for k in range(N_KINDS)}
            allocated = {KINDS[k]: self._allocated[k] for k in range(N_KINDS)}
            counts = (self.allocs, self.frees, self._peak_total, self.arena_allocs, self.oom_count, self.oom_retries,
                      self.redzone_scans, self.graph_launches, self.quarantined_count, self.quarantined_bytes,
                      self.redzone_sample, self.reusable_count, self.reusable_bytes)
        finally:
            release_lock(self._lock)
        return MemoryStats(
            alloc_count=counts[0],
            free_count=counts[1],
            current_bytes=current,
            peak_bytes=peak,
            peak_total_bytes=counts[2],
            arena_capacity=arena_capacity,
            arena_used=arena_used,
            arena_allocs=counts[3] + arena_allocs,
            oom_count=counts[4],
            oom_retries=counts[5],
            redzone_scans=counts[6],
            graph_launches=counts[7],
            redzone_quarantined=counts[8],
            redzone_quarantined_bytes=counts[9],
            redzone_sample=counts[10],
            redzone_reusable=counts[11],
            redzone_reusable_bytes=counts[12],
            allocated_bytes=allocated,
        )
