# The compiled pool's C-level door, for the compiled pool lane: `take_c`, `handed_out_c` and `give_c` are `take`,
# `handed_out` and `give` without a Python call. `_closed` is read by the lane as the pure class's ``closed``.

cimport cython

from metrale_core._device._lock cimport lock_t
from metrale_core._memory._ledger cimport Ledger


@cython.final
cdef class _Segment:
    cdef public object ptr
    cdef public long long nbytes
    cdef public long long used
    cdef public long long out


@cython.final
cdef class MemoryPool:
    cdef lock_t _lock
    cdef object _front
    cdef bint _closed
    cdef dict _segments
    cdef list _small
    cdef dict _free
    cdef dict _out
    cdef long long _epoch
    cdef long long _cached
    cdef long long _hits
    cdef long long _misses
    cdef long long _given_back
    cdef long long _segment_bytes
    cdef long long _piece_bytes
    cdef object _threshold
    cdef bint _strand
    cdef object __weakref__

    cdef object take_c(self, long long size, object stream, bint zoned)
    cdef tuple _carve(self, _Segment segment, long long size)
    cdef int handed_out_c(self, object index, object ptr, long long size, _Segment segment, object stream,
                          bint zoned, Ledger ledger, object buf) except -1
    cdef int give_c(self, object index, object stream) except -1
    cdef void _cache(self, object ptr, long long size, _Segment segment, object stream, bint zoned) except *
