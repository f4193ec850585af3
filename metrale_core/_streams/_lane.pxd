# lane.py compiled as ``_lane``: the stream lane's fields as C types, the gate passed at C level (``_gate.pxd``), the
# ledger asked at C level (``_ledger.pxd``), a buffer's and a stream's fields read in place
# (``_device/_fields.pxd``), and the plugin's C ``memset`` (``_device/_calls.pxd``) called by `call_memset`, which
# lane.py names only where it is compiled.

cimport cython
from cpython.object cimport PyObject
from libc.stdint cimport uintptr_t

from metrale_core._device._calls cimport DEVICE_CALLS_MEMSET, device_calls_with, metrale_device_calls_v1, table_of
from metrale_core._device._fields cimport DeviceBuffer, Stream, check_fields
from metrale_core._device._gate cimport Gate, _Cell
from metrale_core._memory._ledger cimport Ledger


@cython.final
cdef class StreamLane:
    cdef object _streams
    cdef object _ctx
    cdef Gate _gate
    cdef Ledger _ledger
    cdef object _holdings
    cdef object _ref
    cdef Stream _default  # (its capture is read at each call)
    cdef object _guard
    cdef object _calls  # the plugin's capsule (keeps its struct alive), or None
    cdef metrale_device_calls_v1* _table  # its struct, or NULL

    @cython.locals(cell=_Cell)
    cpdef memset(self, object dst, object value, object offset, object nbytes, object stream)
    @cython.locals(buf=DeviceBuffer, target=Stream, size=object, count=object, ptr=object)
    cdef bint _memset(self, object dst, object value, object offset, object nbytes, object stream) except -1

    cdef bint _closed(self) except -1


cdef inline object memset_calls(StreamLane lane, object plugin, bytes name):
    """The plugin's capsule (named ``name``) where its struct holds ``memset`` (its struct kept in ``lane._table``),
    else None."""
    capsule = device_calls_with(plugin, name, DEVICE_CALLS_MEMSET)
    lane._table = table_of(capsule, name)
    return capsule


cdef inline int call_memset(StreamLane lane, object ptr, object value, object nbytes, object stream) except -1:
    """The plugin's C ``memset``: 0 where done, 1 where declined; -1 raised the plugin's typed error."""
    return lane._table.memset(lane._table.state, <uintptr_t>ptr, <int>value, <size_t>nbytes, <PyObject*>stream)
