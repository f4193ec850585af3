# The compiled red-zone table's C-level door, for the compiled lane and quarantine: `add_c` adds the zones of a new
# allocation from its address and size (as ``layout`` and ``zones_for`` lay them out), `remove_c` forgets them
# without making their `Zone` objects, `zone_bytes_c` says how many bytes they hold (-1: none).

cimport cython
from libc.stdint cimport uint64_t, uintptr_t

from metrale_core._device._lock cimport lock_t


cdef class _Rec:
    cdef object buf
    cdef object zones
    cdef uint64_t lead_start, lead_len, trail_start, trail_len
    cdef Py_ssize_t lead_slot, trail_slot


cdef class RedZones:
    cdef lock_t _lock
    cdef dict _recs
    cdef list _slots
    cdef uint64_t* _table
    cdef Py_ssize_t _capacity
    cdef dict _patterns
    cdef readonly object _lead_bytes
    cdef uint64_t _lead_c
    cdef uint64_t _trail_c
    cdef readonly object size
    cdef readonly object min_idx
    cdef readonly int fill
    cdef readonly bint lead
    cdef readonly object sample
    cdef readonly long long version
    cdef readonly long long filled
    cdef object _seen

    cdef int _grow(self, Py_ssize_t slots) except -1
    cdef int _put(self, object index, _Rec rec) except -1
    cdef int add_c(self, object buf, object index, uintptr_t ptr, size_t nbytes) except -1
    cdef void _drop_slot(self, Py_ssize_t slot) noexcept
    cdef _Rec _take(self, object index)
    cdef bint remove_c(self, object index) except -1
    cdef Py_ssize_t zone_bytes_c(self, object index) except -2
    cdef tuple _live(self)
    cdef tuple batch_c(self, list indexes)
