# stats.py compiled as ``_stats``: the counter's fields as C integers under the C lock of ``_lock.pxd``, and its
# methods the compiled parts call at C level (``from metrale_core._device._stats cimport KIND_DEVICE, StatsCounter``):
# `allocated_c` and `released_c` (the kind's index at hand: ``KIND_DEVICE`` is ``"device"``), `quarantined`,
# `reusable`.

cimport cython

from metrale_core._device._lock cimport acquire_lock, lock_t, new_lock, release_lock

# the kinds, in KINDS's order (``memory_stats.KINDS``; the module checks it as it loads): an allocation's kind is
# one of them
cdef enum:
    N_KINDS = 4
    KIND_DEVICE = 0
    KIND_POOL = 3

cdef dict _INDEX


@cython.final
cdef class StatsCounter:
    cdef lock_t _lock
    cdef long long _current[N_KINDS]
    cdef long long _peak[N_KINDS]
    cdef long long _allocated[N_KINDS]
    cdef long long _peak_total
    cdef long long _total
    cdef public long long allocs
    cdef public long long frees
    cdef public long long arena_allocs
    cdef public long long oom_count
    cdef public long long oom_retries
    cdef public long long redzone_scans
    cdef public long long graph_launches
    cdef public long long quarantined_count
    cdef public long long quarantined_bytes
    cdef public long long reusable_count
    cdef public long long reusable_bytes
    cdef public long long redzone_sample

    cpdef void quarantined(self, long long count, long long nbytes) noexcept
    cpdef void reusable(self, long long count, long long nbytes) noexcept
    cpdef void allocated(self, object kind, long long nbytes) except *
    cpdef void released(self, object kind, long long nbytes) except *
    @cython.locals(now=cython.longlong)
    cpdef void allocated_c(self, int k, long long nbytes) noexcept
    cpdef void released_c(self, int k, long long nbytes) noexcept
    @cython.locals(total=cython.longlong, k=cython.int)
    cpdef void reset_peak(self) noexcept

