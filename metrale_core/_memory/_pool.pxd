# pool.py compiled as ``_pool``: the pool's fields as C types under the C lock of ``_lock.pxd``, and the methods the
# compiled pool front (``pools.py`` compiled as ``_pools``) calls at C level
# (``from metrale_core._memory._pool cimport MemoryPool, Segment``): `take`, `handed_out`, `give`, `give_untaken`.

cimport cython

from metrale_core._device._lock cimport acquire_lock, lock_t, new_lock, release_lock
from metrale_core._memory._ledger cimport Ledger


@cython.final
cdef class Segment:
    cdef public object ptr
    cdef public long long nbytes
    cdef public long long used
    cdef public long long out


@cython.final
cdef class MemoryPool:
    cdef lock_t _lock
    cdef object _front
    cdef object _grow
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
    cdef readonly bint for_capture
    cdef object __weakref__

    cpdef tuple take(self, object size, object stream, int fill, object n, str what)
    @cython.locals(cached=list, segment=Segment, keys=tuple)
    cdef tuple _find(self, long long size, object stream, int fill)
    cdef tuple _carve(self, Segment segment, long long size)
    cpdef int handed_out(self, object index, object ptr, object size, Segment segment, object stream, bint zoned,
                         Ledger ledger, object buf) except -1
    @cython.locals(held=tuple)
    cpdef give(self, object index, object stream, object laid=*)
    cpdef give_untaken(self, object ptr, object size, Segment segment, object stream)
    @cython.locals(cached=list)
    cdef int _cache(self, object ptr, long long size, Segment segment, object stream, bint zoned, object laid) except -1


cpdef object size_class(object nbytes)
