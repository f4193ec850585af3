# ledger.py compiled as ``_ledger``: the Ledger's fields as C types, its lock the C lock of ``_lock.pxd``, and the
# methods the compiled callers call at C level (``from metrale_core._memory._ledger cimport Ledger``): `commit`,
# `take` and `has_index` (the lane, the pool, the launch's pack).

cimport cython

from metrale_core._device._gate cimport Gate
from metrale_core._device._lock cimport acquire_lock, lock_t, new_lock, release_lock


@cython.final
cdef class Ledger:
    cdef lock_t _lock
    cdef dict _records
    cdef object _events
    cdef double _start
    cdef public Py_ssize_t dropped
    cdef public Py_ssize_t taken
    cdef public Py_ssize_t history
    cdef public object origin
    cdef object _stack

    cdef void _log(self, str op, object record, tuple stack=*) except *
    cpdef bint commit(self, object index, object buf, Gate gate) except -1
    cpdef object take(self, object index, object ptr, object nbytes)
    cpdef bint has_index(self, object index, object buf) except -1
