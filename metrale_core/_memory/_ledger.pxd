# The compiled ledger's C-level door, for the compiled lane: `add_c` and `take_c` are `add` and `take` without a
# Python call (the caller has the buffer's index at hand); `has_c` is `has` likewise. `add_c` adds only while ``gate``
# is open (where one is given), judged under the ledger's lock (what `drain` takes): the compiled lane's commit.

cimport cython

from metrale_core._device._gate cimport Gate
from metrale_core._device._lock cimport lock_t


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
    cdef int add_c(self, object index, object buf, Gate gate) except -1
    cdef object take_c(self, object index, object ptr, object nbytes)
    cdef bint has_c(self, object index, object buf)
