# quarantine.py compiled as ``_quarantine``: the quarantine's fields as C types (the zone table and the stats the
# compiled ones, called at C level), and what the compiled lane calls at C level (``from metrale_core._memory._quarantine
# cimport Quarantine``): `reuse_c` is `reuse` of a layout named by its raw size (within one backend the raw size names
# the layout), `free_c` is `free` with the buffer's index and size at hand.

cimport cython

from metrale_core._device._stats cimport StatsCounter as _StatsCounter
from metrale_core._redzones._layout cimport RedZones


@cython.final
cdef class _Held:
    cdef public object buf
    cdef public object index
    cdef public tuple zones
    cdef public object raw_ptr
    cdef public object kind
    cdef public object raw_bytes


@cython.locals(held=_Held)
cdef _Held _held(object buf, object index, object nbytes, tuple zones, object raw_ptr, object kind)


@cython.final
cdef class Quarantine:
    cdef object _ctx
    cdef object _raw
    cdef _StatsCounter _stats
    cdef object _guard
    cdef RedZones _zones
    cdef object _lock
    cdef object _bound
    cdef list _held
    cdef dict _reuse
    cdef object _pieces
    cdef Py_ssize_t _deferred

    cpdef object reuse_c(self, object raw_bytes)
    @cython.locals(held=_Held, zones=tuple)
    cpdef int free_c(self, object buf, object index, object nbytes, object raw_ptr, object kind) except -1
    @cython.locals(entry=_Held, zones=list)
    cdef list _drain(self, object also=*)
    @cython.locals(held=_Held, zones=RedZones)
    cpdef full_check(self, object found)
    @cython.locals(stats=_StatsCounter)
    cdef _trim(self, object bound)
    cdef void _count_held(self, long long count, long long nbytes) noexcept
    cdef void _count_kept(self, long long count, long long nbytes) noexcept
