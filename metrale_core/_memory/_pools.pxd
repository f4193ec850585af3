# pools.py compiled as ``_pools``: the pool front's fields as C types, the pool and the other twins called at C level
# through their own .pxd (the gate, the capture rule, the handle, the stats, the ledger, the pool, the call site), a
# piece's fields read in place (``_device/_fields.pxd``), and the methods the compiled lane calls at C level
# (``from metrale_core._memory._pools cimport PoolFront``): `free_piece`, `piece_taken`.

cimport cython

from metrale_core._device._capture cimport forbid_during_capture
from metrale_core._device._fields cimport DeviceBuffer, check_fields
from metrale_core._device._gate cimport Gate, _Cell
from metrale_core._device._handle cimport make_buffer
from metrale_core._device._stats cimport KIND_POOL, StatsCounter
from metrale_core._memory._ledger cimport Ledger
from metrale_core._memory._pool cimport MemoryPool, Segment, size_class
from metrale_core._memory._sites cimport call_site
from metrale_core._redzones._layout cimport RedZones


cdef object _foreign_handle(object foreign, str what)


@cython.final
cdef class PoolFront:
    cdef public object ctx
    cdef Gate _gate
    cdef object _holdings
    cdef Ledger _ledger
    cdef dict _pool_of
    cdef dict _raw_base
    cdef object _releases
    cdef StatsCounter _stats
    cdef object _guard
    cdef object _quarantine
    cdef object _raw
    cdef object _swept
    cdef bint _zoned
    cdef RedZones _zones
    cdef dict _lent
    cdef object _trace_idx
    cdef object _internal
    cdef object _ref
    cdef object _indexes
    cdef object _resolve
    cdef public object site_at

    @cython.locals(cell=_Cell, gate=Gate)
    cpdef object pool_alloc(self, MemoryPool pool, object nbytes, object stream, object foreign=*,
                            object stacklevel=*)
    @cython.locals(segment=Segment, zoned=bint)
    cdef object _piece(self, MemoryPool pool, object n, object target, bint foreign, object index, str what,
                       object site)
    cdef int _commit(self, MemoryPool pool, DeviceBuffer buf, object index, object ptr, object size, Segment segment,
                     object target, bint zoned, str what) except -1
    cdef int _untaken(self, MemoryPool pool, object index, object ptr, object size, Segment segment, object target,
                      bint zoned) except -1
    @cython.locals(cell=_Cell, gate=Gate)
    cpdef pool_free(self, MemoryPool pool, object buf, object stream, str what)
    @cython.locals(handle=DeviceBuffer, record=DeviceBuffer)
    cpdef free_piece(self, MemoryPool pool, object buf, object stream, str what)
    @cython.locals(pool=MemoryPool, observers=tuple)
    cpdef piece_taken(self, object buf, DeviceBuffer record, object stream)
