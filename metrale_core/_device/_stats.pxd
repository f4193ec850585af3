# The compiled stats counter's C-level door, for the compiled lane: `allocated_c` and `released_c` are
# `allocated` and `released` with the kind's index at hand (``KIND_DEVICE``: ``"device"``); `quarantined_c` and
# `reusable_c` are `quarantined` and `reusable` (for the compiled quarantine).

cimport cython

from metrale_core._device._lock cimport lock_t

# the kinds, in KINDS's order (``stats.KINDS``; the twin checks it as it loads): an allocation's kind is one of them
cdef enum:
    N_KINDS = 4
    KIND_DEVICE = 0
    KIND_POOL = 3


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

    cdef void allocated_c(self, int k, long long nbytes) noexcept
    cdef void released_c(self, int k, long long nbytes) noexcept
    cdef void quarantined_c(self, long long count, long long nbytes) noexcept
    cdef void reusable_c(self, long long count, long long nbytes) noexcept
