# The compiled quarantine's C-level door, for the compiled lane: `reuse_c` is `reuse` of a layout named by its raw
# size (within one backend the raw size names the layout), `free_c` is `free` with the buffer's index and size at
# hand.

cimport cython

from metrale_core._device._stats cimport StatsCounter
from metrale_core._redzones._layout cimport RedZones


cdef class Quarantine:
    cdef object _ctx
    cdef object _raw
    cdef StatsCounter _stats
    cdef object _guard
    cdef RedZones _zones
    cdef object _lock
    cdef object _bound
    cdef list _held
    cdef dict _reuse
    cdef object _pieces

    cdef object reuse_c(self, object raw_bytes)
    cdef int free_c(self, object buf, object index, object nbytes, object raw_ptr, object kind) except -1
    cdef list _drain(self, object also)
    cdef int _trim(self, object bound) except -1
