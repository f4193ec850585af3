# layout.py compiled as ``_layout``: the zone table's fields as C types, its lock the C lock of ``_lock.pxd``, and what
# the compiled lane and quarantine call at C level (``from metrale_core._redzones._layout cimport RedZones``): `add_c`,
# `zones_of` and `remove`, and the bands (`_lead_bytes`, and `_lead_c`, `_trail_c` as C integers), `size`, `min_idx`,
# `sample` and `fill`.

cimport cython
from libc.stdint cimport uint64_t, uintptr_t

from metrale_core._device._lock cimport acquire_lock, lock_t, new_lock, release_lock
from metrale_core._device._slots cimport slot_set, slots_to_build

# Zone's slots, where a Zone is made by storing them in place (`_zone`)
cdef bint _Z_DIRECT
cdef Py_ssize_t _Z_BUFFER, _Z_SIDE, _Z_START, _Z_LENGTH

cdef object _zone(object buf, str side, object start, object length)


@cython.final
cdef class RedZones:
    cdef lock_t _lock
    cdef dict _zones
    cdef list _slots
    cdef dict _slot_of
    cdef object _table
    cdef dict _patterns
    cdef tuple _seen
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

    cpdef object layout(self, object nbytes, object index)
    cpdef int add_c(self, object buf, object index, uintptr_t ptr, size_t nbytes, bint filled=*) except -1
    @cython.locals(slots=list)
    cdef _put(self, object index, tuple zones, bint filled=*)
    cpdef tuple remove(self, object index)
    cdef tuple _take(self, object index)
    cpdef tuple zones_of(self, object index)
    @cython.locals(slots=list)
    cdef _drop(self, Py_ssize_t slot)
    @cython.locals(version=cython.longlong, same=bint, seen=tuple)
    cdef tuple _read(self, long long known_version)
