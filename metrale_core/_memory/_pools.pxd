# pools.py compiled as ``_pools``: the pool front's fields as C types, the pool and the other twins called through
# their C-level doors (``_hot.pxd``, ``_pool.pxd``, ``_ledger.pxd``), and the methods the compiled lane calls at C
# level (``from metrale_core._memory._pools cimport PoolFront``): `free_piece`, `piece_taken`.

cimport cython

from metrale_core._device._gate cimport Gate, _Cell
from metrale_core._device._stats cimport StatsCounter
from metrale_core._memory._hot cimport (
    buf_index, buf_kind, buf_nbytes, buf_owner, buf_ptr, forbid, gate_in, gate_out, interrupted, make_buffer,
    pool_in, pool_out,
)
from metrale_core._memory._ledger cimport Ledger
from metrale_core._memory._pool cimport MemoryPool, Segment, size_class
from metrale_core._memory._sites cimport call_site


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
    cdef int _commit(self, MemoryPool pool, object buf, object index, object ptr, object size, Segment segment,
                     object target, bint zoned, str what) except -1
    cdef int _untaken(self, MemoryPool pool, object index, object ptr, object size, Segment segment,
                      bint zoned) except -1
    @cython.locals(cell=_Cell, gate=Gate)
    cpdef pool_free(self, MemoryPool pool, object buf, object stream, str what)
    cpdef free_piece(self, MemoryPool pool, object buf, object stream, str what)
    @cython.locals(pool=MemoryPool, observers=tuple)
    cpdef piece_taken(self, object buf, object record, object stream)
