# cython: language_level=3, binding=True, embedsignature=True
"""The compiled twin of [`StatsCounter`][metrale_core._device.stats.StatsCounter]: the same interface and
behaviour, its counters C integers (one per kind of memory in ``KINDS``) under a C-level lock.

- The pure class in ``stats.py`` is the reference; `_twins.pick` chooses per backend.
- The counters the pure class bumps without its lock (a lost count under a race is harmless for a
  statistic) are public C integers here, read and written from Python as before.
"""

cimport cython

from metrale_core._device._lock cimport acquire, lock_t, release

from .stats import KINDS as _KINDS
from .stats import MemoryStats

if len(_KINDS) != N_KINDS or _KINDS[KIND_DEVICE] != "device" or _KINDS[KIND_POOL] != "pool":  # (the loader falls back, saying why)
    raise ImportError(f"the stats twin counts {N_KINDS} kinds of memory, device first, pool last; KINDS is {_KINDS}")


cdef dict _INDEX = {name: i for i, name in enumerate(_KINDS)}


cdef inline int _kind(str kind) except -1:
    return _INDEX[kind]  # (a KeyError for another kind, as the pure class raises)


@cython.final
cdef class StatsCounter:
    """The mutable counters behind `MemoryStats`; thread-safe (compiled twin)."""

    def __init__(self):
        cdef int i
        for i in range(N_KINDS):
            self._current[i] = 0
            self._peak[i] = 0
            self._allocated[i] = 0
        self._peak_total = 0
        self._total = 0
        self.allocs = 0
        self.frees = 0
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

    def quarantined(self, long long count, long long nbytes):
        """Buffers entered (positive) or left (negative) the red-zone quarantine."""
        self.quarantined_c(count, nbytes)

    cdef void quarantined_c(self, long long count, long long nbytes) noexcept:
        acquire(&self._lock)
        self.quarantined_count += count
        self.quarantined_bytes += nbytes
        release(&self._lock)

    def reusable(self, long long count, long long nbytes):
        """Checked zoned blocks entered (positive) or left (negative) the red zones' reuse lists."""
        self.reusable_c(count, nbytes)

    cdef void reusable_c(self, long long count, long long nbytes) noexcept:
        acquire(&self._lock)
        self.reusable_count += count
        self.reusable_bytes += nbytes
        release(&self._lock)

    def allocated(self, str kind, long long nbytes):
        self.allocated_c(_kind(kind), nbytes)

    cdef void allocated_c(self, int k, long long nbytes) noexcept:
        cdef long long now
        acquire(&self._lock)
        try:
            self.allocs += 1
            now = self._current[k] + nbytes
            self._current[k] = now
            if now > self._peak[k]:
                self._peak[k] = now
            self._allocated[k] += nbytes
            self._total += nbytes
            if self._total > self._peak_total:
                self._peak_total = self._total
        finally:
            release(&self._lock)

    def released(self, str kind, long long nbytes):
        self.released_c(_kind(kind), nbytes)

    cdef void released_c(self, int k, long long nbytes) noexcept:
        acquire(&self._lock)
        try:
            self.frees += 1
            self._current[k] -= nbytes
            self._total -= nbytes
        finally:
            release(&self._lock)

    def reset_peak(self):
        cdef int i
        cdef long long total = 0
        acquire(&self._lock)
        try:
            for i in range(N_KINDS):
                self._peak[i] = self._current[i]
                total += self._current[i]
            self._peak_total = total
        finally:
            release(&self._lock)

    def freeze(self, arena_capacity, arena_used, arena_allocs):
        """The counters now, with what the open arenas hold (closed ones were counted as they closed)."""
        cdef int i
        acquire(&self._lock)
        try:
            current = {_KINDS[i]: self._current[i] for i in range(N_KINDS)}
            peak = {_KINDS[i]: self._peak[i] for i in range(N_KINDS)}
            allocated = {_KINDS[i]: self._allocated[i] for i in range(N_KINDS)}
            counts = (self.allocs, self.frees, self._peak_total, self.arena_allocs, self.oom_count,
                      self.oom_retries, self.redzone_scans, self.graph_launches, self.quarantined_count,
                      self.quarantined_bytes, self.redzone_sample, self.reusable_count, self.reusable_bytes)
        finally:
            release(&self._lock)
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
