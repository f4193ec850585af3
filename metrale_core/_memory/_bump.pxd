# bump.py compiled as ``_bump``: the arena's fields as C types (the block's base, capacity and top as C integers: a
# block lies within the 64-bit address space), its lock the C lock of ``_lock.pxd``, and each piece's buffer made by
# the handle's C-level ``make_buffer`` (``_handle.pxd``).

cimport cython

from metrale_core._device._handle cimport make_buffer
from metrale_core._device._lock cimport acquire_lock, lock_t, new_lock, release_lock

cdef unsigned long long _WORD_MAX


@cython.final
cdef class Arena:
    cdef lock_t _lock
    cdef object _block
    cdef unsigned long long _base
    cdef unsigned long long _capacity
    cdef unsigned long long _top
    cdef dict _pieces
    cdef unsigned long long _era
    cdef object _on_close
    cdef object _owner
    cdef object _where
    cdef object _where_at
    cdef object _zones
    cdef public object site
    cdef public long long allocs

    @cython.locals(era=cython.ulonglong)
    cdef object _piece(self, object nbytes, object align, object site, object index, object lead, object trail)
    @cython.locals(n=cython.ulonglong, a=cython.ulonglong, ahead=cython.ulonglong, behind=cython.ulonglong,
                   top=cython.ulonglong, room=cython.ulonglong, skip=cython.ulonglong, pad=cython.ulonglong)
    cdef object _bump(self, object nbytes, object align, object lead, object trail)
    cdef object _zoned(self, object nbytes, object align, object site, object zones)
    cpdef _reset(self)
    cpdef _close(self)
    cdef _forget(self)
